"""YAML config -> frozen, validated objects.

No file at all means the embedded default: everything under ``$ISOLANE_HOME`` (default
``./isolane-data``), one local write group for checkpoints and one read group for the
KV pool. Every field has a default; unknown fields are refused so that a typo never
silently falls back to a default. A field that was removed (``REMOVED_FIELDS``) is
ignored with a :class:`RemovedFieldWarning` that says what to do, so a config written
for an older version still loads. Relative device paths in a file are resolved against
the file's directory; in a dict or the default, against the current directory.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

import yaml

from isolane.bounded_json import DEPTH_CEILING as MAX_JSON_DEPTH
from isolane.cluster.chain_segments import DEFAULT_SEGMENT_BLOCKS, MAX_SEGMENT_BLOCKS
from isolane.cluster.etcd_client import parse_etcd_url
from isolane.cluster.rendezvous import PLACEMENTS
from isolane.errors import ConfigError, InvalidArgumentError, InvalidNameError
from isolane.kvpool.namespaces import check_namespace
from isolane.kvpool.tiers.memory_policy import POLICIES
from isolane.units import parse_size

Role = Literal["write", "read", "capacity"]
DirectIO = Literal["auto", "on", "off"]
ROLES: tuple[Role, ...] = ("write", "read", "capacity")
DEFAULT_HOME = "./isolane-data"


class SharedDiskWarning(UserWarning):
    """Two device groups sit on one physical disk: isolation is only logical there."""


class RemovedFieldWarning(UserWarning):
    """A config sets a field that was removed: it is ignored; delete it from the file."""


REMOVED_FIELDS: Mapping[str, str] = {
    "cluster.replicas": (
        "hot replicas were removed: in the routing benchmark they lowered max/mean load "
        "in 3 of 20 cases and cost 2.5-9.8 points of block hit rate there "
        "(docs/BENCHMARKS.md, 'Reading the routing numbers'); bounded loads "
        "(cluster.load_bound) keep nodes within their share instead"),
    "qos.write_bandwidth_step": (
        "it was the additive step of the AIMD law, which was removed: the latency-target "
        "law sizes its own steps from the read p99; delete the field"),
}
"""Removed config fields (``section.field``) and why; see :class:`RemovedFieldWarning`."""


@dataclass(frozen=True)
class DeviceGroupConfig:
    name: str
    role: Role
    devices: tuple[str, ...]
    threads: int = 4
    inflight_bytes: int = 512 << 20
    direct_io: DirectIO = "auto"
    memory_budget: int | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SnapshotConfig:
    keep_last: int | None = None
    mirror: bool = False
    staging_budget: int = 4 << 30
    chunk_bytes: int = 32 << 20
    pack_threshold: int = 1 << 20
    gc_grace_s: float = 3600.0
    mirror_attempts: int = 3
    mirror_backoff_s: float = 1.0


@dataclass(frozen=True)
class KVPoolConfig:
    namespace: str = "default"
    chunk_tokens: int = 256
    policy: str = "s3fifo"
    segment_bytes: int = 256 << 20
    disk_budget: int | None = None


@dataclass(frozen=True)
class QosConfig:
    """The governor's settings (see ``isolane.lanes.qos``); bandwidths in bytes/s."""

    read_p99_slo_ms: float = 5.0
    write_bandwidth_max: int | None = None  # static cap on checkpoint writes; None: none
    write_bandwidth_min: int = 100 << 20  # floor: checkpoints always progress
    governor: bool = True
    read_p99_window_s: float = 1.0
    governor_period_s: float = 0.1
    decrease_factor: float = 0.5  # per cut; the background lane gets its square
    background_share: float = 0.25  # background floor, relative to writes
    io_priorities: bool = True  # per-lane I/O priority classes (see isolane.lanes.ioprio)
    control: str = "target"  # the control law: "target" (latency target), the only one
    host_plane: bool = True  # share one lane plane with every process on this config
    plane_dir: str | None = None  # where the plane file lives; None: /dev/shm


@dataclass(frozen=True)
class NodeConfig:
    """A storage node's address, token and caps (docs/API.md, "Limits and caps"): each
    cap is checked before a request's work starts (413 or 400 naming the field)."""

    host: str = "127.0.0.1"
    port: int = 7070
    token: str | None = None
    max_snapshot_tensors: int = 100_000  # tensors in one snapshot upload or plan
    max_snapshot_chunks: int = 1_000_000  # chunks in one snapshot upload
    max_snapshot_pieces: int = 2_000_000  # chunk pieces (tensor slices) in one upload
    max_header_bytes: int = 64 << 20  # a snapshot stream's JSON header
    max_json_depth: int = 256  # nesting of any JSON a node parses (bodies, headers)
    max_request_bytes: int = 256 << 20  # a KV batch body
    max_block_bytes: int = 64 << 20  # one KV block value
    max_batch_blocks: int = 1 << 16  # keys or frames in one KV request
    max_upload_bytes: int | None = None  # a snapshot upload's tensor bytes (None: no cap)
    # a multi-rank save begun here, neither committed nor touched by a part for this
    # long, is abandoned and its leftovers removed (DCP's own collective timeout: 30 min)
    part_save_lease_s: float = 1800.0


@dataclass(frozen=True)
class EtcdConfig:
    """Membership through etcd (``cluster.etcd``): nodes register under a lease, clients
    watch ``url``'s prefix (``isolane.cluster.etcd_membership``)."""

    url: str = ""  # etcd://HOST:PORT/PREFIX (etcds:// for TLS)
    lease_ttl_s: int = 5  # a node that stops refreshing its lease leaves after this long
    user: str | None = None
    password: str | None = None  # also ISOLANE_ETCD_PASSWORD
    ca_file: str | None = None  # TLS: the CA that signed etcd's certificate
    cert_file: str | None = None  # TLS client certificate (etcd --client-cert-auth)
    key_file: str | None = None
    static_fallback: bool = False  # etcd down at client start: use cluster.nodes


@dataclass(frozen=True)
class ClusterConfig:
    nodes: tuple[str, ...] = ("http://127.0.0.1:7070",)
    etcd: EtcdConfig | None = None  # membership through etcd instead of ``nodes``
    load_bound: float = 1.25
    segment_blocks: int = DEFAULT_SEGMENT_BLOCKS  # blocks per chain segment (placement unit)
    prefix_blocks: int = 2  # k: a chain's routing digest is the key of its block k - 1
    placement: str = "ring"  # segment digests on nodes: "ring" (consistent hash) or "rendezvous"


@dataclass(frozen=True)
class Config:
    home: str
    device_groups: Mapping[str, DeviceGroupConfig]
    snapshot: SnapshotConfig = SnapshotConfig()
    kvpool: KVPoolConfig = KVPoolConfig()
    qos: QosConfig = QosConfig()
    node: NodeConfig = NodeConfig()
    cluster: ClusterConfig = ClusterConfig()
    source: str = "<embedded default>"

    def group(self, role: Role) -> DeviceGroupConfig | None:
        """The group with ``role`` (the loader guarantees at most one per role)."""
        for group in self.device_groups.values():
            if group.role == role:
                return group
        return None

    def require_group(self, role: Role) -> DeviceGroupConfig:
        group = self.group(role)
        if group is None:
            raise ConfigError(
                "device_groups", f"no group has role '{role}'; add one, e.g. "
                f"'mygroup: {{role: {role}, devices: [/path/to/dir]}}' ({self.source})"
            )
        return group


def is_url(device: str) -> bool:
    return "://" in device and not device.startswith("file://")


def default_home() -> str:
    return os.environ.get("ISOLANE_HOME") or DEFAULT_HOME


def default_config(home: str | None = None) -> Config:
    """The embedded default: one local folder, no server."""
    return config_from_dict({}, home=home)


def store_config(url: str, storage_options: Mapping[str, Any] | None = None) -> Config:
    """A config whose write group is the single device ``url`` (a folder or URL)."""
    data = {
        "home": url if not is_url(url) else default_home(),
        "device_groups": {
            "checkpoint": {"role": "write", "devices": [url],
                           "storage_options": dict(storage_options or {})},
        },
    }
    return config_from_dict(data, source=url)


def is_node_target(target: object) -> bool:
    """Whether ``SnapshotStore(target)``/``KVPool(target)`` names storage nodes: an
    ``http(s)://`` URL (several joined by commas) or a list/tuple of URLs."""
    if isinstance(target, str):
        return target.lstrip().lower().startswith(("http://", "https://"))
    return isinstance(target, list | tuple) and all(isinstance(t, str) for t in target)


def is_etcd_target(target: object) -> bool:
    """Whether ``target`` is an ``etcd://`` (or ``etcds://``) URL: the storage nodes
    registered under its prefix."""
    return isinstance(target, str) and target.lstrip().lower().startswith(
        ("etcd://", "etcds://"))


def refuse_etcd_store(target: object) -> NoReturn:
    """Snapshots are not placed by membership: a store needs one node's URL."""
    raise InvalidArgumentError(
        f"{target!r}: etcd membership places KV blocks; a snapshot store is opened by a "
        "node URL (http://HOST:PORT), a folder, a config or an s3:// URL")


def refuse_node_target(target: object, kind: str, opener: str) -> None:
    """A class that opens one kind of target (``kind``, the embedded one) was given
    storage node URLs: the error names the ``isolane.<opener>`` call that opens both."""
    if is_etcd_target(target) and kind != "KVPool":
        refuse_etcd_store(target)
    if is_node_target(target) or is_etcd_target(target):
        raise InvalidArgumentError(
            f"{target!r} names storage nodes, which the embedded {kind} does not open: use "
            f"isolane.{opener}({target!r}) (the Remote{kind} client for node URLs, the "
            f"embedded {kind} for folders and configs)")


def node_url_list(target: str | Sequence[str]) -> list[str]:
    """The URLs of a node target (``is_node_target``), commas split."""
    if isinstance(target, str):
        return [url.strip() for url in target.split(",")]
    return list(target)


def target_config(target: str | os.PathLike[str] | Config | None,
                  role: Literal["write", "read"],
                  storage_options: Mapping[str, Any] | None = None) -> Config:
    """The config an embedded ``SnapshotStore`` (role ``write``) or ``KVPool`` (role
    ``read``) opens for ``target``: a ``Config`` itself, a YAML file's, the default one
    (None), else a group of that role on the one folder or fsspec URL ``target`` names."""
    if target is None:
        return default_config()
    if isinstance(target, Config):
        return target
    text = os.fspath(target)
    if not is_url(text) and text.endswith((".yaml", ".yml")) and Path(text).is_file():
        return load_config(text)
    if role == "write":
        return store_config(text, storage_options)
    return config_from_dict({"device_groups": {"kv": {
        "role": "read", "devices": [text], "storage_options": dict(storage_options or {})}}})


def load_config(path: str | os.PathLike[str]) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("<file>", f"config file {path} does not exist") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"{path} is not valid YAML: {exc}") from None
    except RecursionError:  # PyYAML's parser recurses once per nesting level
        raise ConfigError("<file>", f"{path} nests too deep to be a config; a config is "
                          "a few levels of mappings") from None
    if not isinstance(data, dict):
        raise ConfigError("<file>", f"{path} must hold a mapping at the top level")
    return config_from_dict(data, base_dir=path.parent, source=str(path))


def config_from_dict(
    data: Mapping[str, Any],
    *,
    base_dir: str | os.PathLike[str] | None = None,
    home: str | None = None,
    source: str = "<embedded default>",
) -> Config:
    _refuse_unknown("", data, {f.name for f in fields(Config)} - {"source"})
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    home_value = home or data.get("home") or default_home()
    if not isinstance(home_value, str):
        raise ConfigError("home", f"expected a folder path, got {home_value!r}")
    home_path = _resolve_path(home_value, base)
    raw_groups = data.get("device_groups")
    explicit_groups = raw_groups is not None
    if raw_groups is None:
        raw_groups = {
            "checkpoint": {"role": "write", "devices": [os.path.join(home_path, "checkpoints")]},
            "kv": {"role": "read", "devices": [os.path.join(home_path, "kv")]},
        }
    if not isinstance(raw_groups, Mapping):
        raise ConfigError("device_groups", "expected a mapping of group name to settings")
    groups = {
        str(name): _parse_group(str(name), spec, base) for name, spec in raw_groups.items()
    }
    _check_groups(groups, warn_shared_disks=explicit_groups)
    qos = _parse_section("qos", QosConfig, data.get("qos"))
    if qos.plane_dir is not None:
        qos = replace(qos, plane_dir=_resolve_path(qos.plane_dir, base))
    config = Config(
        home=home_path,
        device_groups=groups,
        snapshot=_parse_section("snapshot", SnapshotConfig, data.get("snapshot")),
        kvpool=_parse_section("kvpool", KVPoolConfig, data.get("kvpool")),
        qos=qos,
        node=_parse_section("node", NodeConfig, data.get("node")),
        cluster=_parse_cluster(data.get("cluster"), base),
        source=source,
    )
    check_config(config)
    return config


def with_snapshot(config: Config, **changes: Any) -> Config:
    return replace(config, snapshot=replace(config.snapshot, **changes))


# -- parsing helpers -------------------------------------------------------------------

_SIZE_FIELDS = {"inflight_bytes", "memory_budget", "staging_budget", "chunk_bytes",
                "pack_threshold", "write_bandwidth_max", "write_bandwidth_min",
                "segment_bytes", "disk_budget", "max_header_bytes", "max_request_bytes",
                "max_block_bytes", "max_upload_bytes"}


def _refuse_unknown(prefix: str, data: Mapping[str, Any], known: set[str]) -> None:
    for key in data:
        if key not in known:
            where = f"{prefix}{key}"
            raise ConfigError(where, f"unknown field; known fields: {', '.join(sorted(known))}")


def _resolve_path(value: str, base: Path) -> str:
    if value.startswith("file://"):
        value = value[len("file://"):]
    expanded = os.path.expanduser(os.path.expandvars(value))
    return str(Path(expanded) if os.path.isabs(expanded) else (base / expanded))


def _parse_group(name: str, spec: Any, base: Path) -> DeviceGroupConfig:
    where = f"device_groups.{name}"
    if not isinstance(spec, Mapping):
        raise ConfigError(where, "expected a mapping with at least 'role' and 'devices'")
    _refuse_unknown(where + ".", spec, {f.name for f in fields(DeviceGroupConfig)} - {"name"})
    role = spec.get("role")
    if role not in ROLES:
        raise ConfigError(where + ".role", f"expected one of {', '.join(ROLES)}, got {role!r}")
    devices = spec.get("devices")
    if isinstance(devices, str):
        devices = [devices]
    if not devices or not isinstance(devices, list | tuple):
        raise ConfigError(where + ".devices", "a device group needs at least one device")
    resolved = []
    for device in devices:
        if not isinstance(device, str) or not device.strip():
            raise ConfigError(where + ".devices", f"expected a path or URL, got {device!r}")
        if is_url(device) and not device.split("://", 1)[1].strip("/"):
            raise ConfigError(where + ".devices", f"{device!r} names no bucket or host; "
                              "give one, e.g. s3://my-bucket/checkpoints")
        resolved.append(device.rstrip("/") if is_url(device) else _resolve_path(device, base))
    kwargs = {k: v for k, v in spec.items() if k not in {"role", "devices"}}
    kwargs = _coerce(where, DeviceGroupConfig, kwargs)
    return DeviceGroupConfig(name=name, role=role, devices=tuple(resolved), **kwargs)


def _parse_section(name: str, cls: Any, spec: Any) -> Any:
    if spec is None:
        return cls()
    if not isinstance(spec, Mapping):
        raise ConfigError(name, "expected a mapping")
    spec = _drop_removed(name, spec)
    _refuse_unknown(name + ".", spec, {f.name for f in fields(cls)})
    return cls(**_coerce(name, cls, dict(spec)))


def _parse_cluster(spec: Any, base: Path) -> ClusterConfig:
    """``cluster``, whose ``etcd`` is a mapping (or just its URL)."""
    if not isinstance(spec, Mapping) or "etcd" not in spec:
        return _parse_section("cluster", ClusterConfig, spec)  # type: ignore[no-any-return]
    rest = dict(spec)
    etcd_spec = rest.pop("etcd")
    cluster: ClusterConfig = _parse_section("cluster", ClusterConfig, rest)
    if etcd_spec is None:
        return cluster
    if isinstance(etcd_spec, str):
        etcd_spec = {"url": etcd_spec}
    etcd: EtcdConfig = _parse_section("cluster.etcd", EtcdConfig, etcd_spec)
    def path(value: str | None) -> str | None:
        return None if value is None else _resolve_path(value, base)

    etcd = replace(etcd, ca_file=path(etcd.ca_file), cert_file=path(etcd.cert_file),
                   key_file=path(etcd.key_file))
    return replace(cluster, etcd=etcd)


def _drop_removed(section: str, spec: Mapping[str, Any]) -> Mapping[str, Any]:
    """``spec`` without its removed fields, each one warned about (once per process and
    field: Python's default warning filter shows a message once per place)."""
    kept = dict(spec)
    for key in spec:
        why = REMOVED_FIELDS.get(f"{section}.{key}")
        if why is not None:
            del kept[key]
            warnings.warn(f"config field {section}.{key} is no longer used and is ignored "
                          f"({why}); delete the line '{key}: {spec[key]!r}' from the "
                          f"'{section}:' section of your config", RemovedFieldWarning,
                          stacklevel=2)
    return kept


def _coerce(where: str, cls: Any, values: dict[str, Any]) -> dict[str, Any]:
    types = {f.name: f.type for f in fields(cls)}
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{where}.{key}"
        kind = str(types[key])
        if value is None and "None" in kind:
            out[key] = None
        elif key == "direct_io" and isinstance(value, bool):
            out[key] = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a bool
        elif key in _SIZE_FIELDS:
            try:
                out[key] = parse_size(value)
            except ValueError as exc:
                raise ConfigError(name, str(exc)) from None
        elif kind.startswith("bool"):
            if not isinstance(value, bool):
                raise ConfigError(name, f"expected true or false, got {value!r}")
            out[key] = value
        elif kind.startswith("int"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(name, f"expected a whole number, got {value!r}")
            out[key] = value
        elif kind.startswith("float"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(name, f"expected a number, got {value!r}")
            out[key] = float(value)
        elif kind.startswith("tuple"):
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list | tuple):
                raise ConfigError(name, f"expected a list, got {value!r}")
            out[key] = tuple(str(v) for v in value)
        elif kind.startswith("Mapping"):
            if not isinstance(value, Mapping):
                raise ConfigError(name, f"expected a mapping, got {value!r}")
            out[key] = dict(value)
        else:
            if not isinstance(value, str):
                raise ConfigError(name, f"expected text, got {value!r}")
            out[key] = value
    return out


def _check_groups(groups: Mapping[str, DeviceGroupConfig], *, warn_shared_disks: bool) -> None:
    owner: dict[str, str] = {}
    for group in groups.values():
        if group.direct_io not in ("auto", "on", "off"):
            raise ConfigError(f"device_groups.{group.name}.direct_io",
                              f"expected auto, on or off, got {group.direct_io!r}")
        if group.threads < 1:
            raise ConfigError(f"device_groups.{group.name}.threads", "must be at least 1")
        if group.inflight_bytes < 1 << 20:
            raise ConfigError(f"device_groups.{group.name}.inflight_bytes",
                              "must be at least 1MiB")
        for device in group.devices:
            key = device if is_url(device) else os.path.realpath(device)
            for other_key, other_group in owner.items():
                if _overlaps(key, other_key):
                    raise ConfigError(
                        f"device_groups.{group.name}.devices",
                        f"device {device} overlaps {other_key} of group '{other_group}'; "
                        "a device belongs to exactly one group — give each its own folder",
                    )
            owner[key] = group.name
    for role in ROLES:
        names = [g.name for g in groups.values() if g.role == role]
        if len(names) > 1:
            raise ConfigError("device_groups", f"groups {', '.join(names)} all have role "
                              f"'{role}'; one group per role is supported")
    if warn_shared_disks:  # the embedded default is one folder by design: no warning
        _warn_shared_disks(groups)


def _overlaps(a: str, b: str) -> bool:
    a_, b_ = a.rstrip("/") + "/", b.rstrip("/") + "/"
    return a_.startswith(b_) or b_.startswith(a_)


def physical_device(path: str) -> int | None:
    """``st_dev`` of the nearest existing ancestor of a local path (None for URLs)."""
    if is_url(path):
        return None
    probe = Path(path)
    while not probe.exists():
        if probe.parent == probe:
            return None
        probe = probe.parent
    return probe.stat().st_dev


K = TypeVar("K", bound=Hashable)


def shared_disks(groups: Iterable[DeviceGroupConfig], disk_of: Callable[[str], K | None]
                 ) -> list[tuple[DeviceGroupConfig, DeviceGroupConfig, K]]:
    """Each pair of groups with devices on one disk, once, in config order.

    ``disk_of`` maps a device to its disk (``physical_device``: the ``st_dev``; the
    ``isolane lanes check`` probe: the whole disk under a partition) or None (a URL).
    """
    ordered = list(groups)
    disks = [{d for d in map(disk_of, g.devices) if d is not None} for g in ordered]
    pairs = []
    for i, first in enumerate(ordered):
        for j in range(i + 1, len(ordered)):
            common = disks[i] & disks[j]
            if common:
                pairs.append((first, ordered[j], min(common, key=repr)))
    return pairs


def _warn_shared_disks(groups: Mapping[str, DeviceGroupConfig]) -> None:
    for first, second, disk in shared_disks(groups.values(), physical_device):
        warnings.warn(
            f"device groups '{first.name}' and '{second.name}' share one physical disk "
            f"(st_dev {disk}); isolation between them is only logical",
            SharedDiskWarning, stacklevel=2,
        )


# -- range checks (pure: no I/O) ---------------------------------------------------------
# Each refusal names the field, what it accepts and, where it helps, the way out. Every
# Config built here goes through ``check_config``; the device groups are checked while
# parsing (they touch the filesystem).

CONTROL_LAWS = ("target",)


def check_config(config: Config) -> None:
    """Refuse a value out of range, naming the field and what it accepts."""
    snap = config.snapshot
    if snap.keep_last is not None and snap.keep_last < 1:
        raise ConfigError("snapshot.keep_last", "must be at least 1 (or null to keep all)")
    if snap.chunk_bytes < 1 << 20 or snap.chunk_bytes % 4096:
        raise ConfigError("snapshot.chunk_bytes", "must be a multiple of 4KiB and >= 1MiB")
    if snap.staging_budget < snap.chunk_bytes:
        raise ConfigError("snapshot.staging_budget",
                          f"must hold at least one chunk ({snap.chunk_bytes} bytes)")
    if snap.mirror_attempts < 1:
        raise ConfigError("snapshot.mirror_attempts", "must be at least 1")
    if snap.pack_threshold > snap.chunk_bytes:
        raise ConfigError("snapshot.pack_threshold", "must not exceed snapshot.chunk_bytes")
    if snap.mirror and config.group("capacity") is None:
        raise ConfigError("snapshot.mirror", "mirror needs a device group with role "
                          "'capacity' (e.g. an s3:// URL)")
    if config.kvpool.chunk_tokens < 1:
        raise ConfigError("kvpool.chunk_tokens", "must be at least 1")
    try:
        check_namespace(config.kvpool.namespace)
    except InvalidNameError as exc:
        raise ConfigError("kvpool.namespace", str(exc)) from None
    if config.kvpool.policy == "wtinylfu":
        raise ConfigError("kvpool.policy", "wtinylfu was removed: it fell far behind LRU "
                          "and S3-FIFO on the KV trace; set s3fifo (the default) or lru")
    if config.kvpool.policy not in POLICIES:
        raise ConfigError("kvpool.policy", f"expected {' or '.join(POLICIES)}, got "
                          f"{config.kvpool.policy!r}")
    if config.kvpool.segment_bytes < 1 << 20:
        raise ConfigError("kvpool.segment_bytes", "must be at least 1MiB")
    budget = config.kvpool.disk_budget
    if budget is not None and budget < 2 * config.kvpool.segment_bytes:
        raise ConfigError("kvpool.disk_budget", "must hold at least two segments "
                          "(2 x kvpool.segment_bytes)")
    check_qos(config.qos)
    if not 0 < config.node.port < 65536:
        raise ConfigError("node.port", f"expected 1-65535, got {config.node.port}")
    for cap in ("max_snapshot_tensors", "max_snapshot_chunks", "max_snapshot_pieces",
                "max_header_bytes", "max_request_bytes", "max_block_bytes",
                "max_batch_blocks", "max_upload_bytes"):
        value = getattr(config.node, cap)
        if value is not None and value < 1:
            raise ConfigError(f"node.{cap}", "must be at least 1" + (
                " (or null for no cap)" if cap == "max_upload_bytes" else ""))
    if not config.node.part_save_lease_s > 0:
        raise ConfigError("node.part_save_lease_s", "must be positive (seconds)")
    if not 8 <= config.node.max_json_depth <= MAX_JSON_DEPTH:
        raise ConfigError("node.max_json_depth", f"expected 8 to {MAX_JSON_DEPTH} (deeper "
                          f"JSON could exhaust the parser's stack), got "
                          f"{config.node.max_json_depth}")
    if config.cluster.load_bound < 1.0:
        raise ConfigError("cluster.load_bound", "must be >= 1.0 (1.25 = 25% above average)")
    blocks = config.cluster.segment_blocks
    if isinstance(blocks, bool) or not isinstance(blocks, int) \
            or not 1 <= blocks <= MAX_SEGMENT_BLOCKS:
        raise ConfigError("cluster.segment_blocks", (
            f"expected a whole number of blocks from 1 to {MAX_SEGMENT_BLOCKS} (1: every "
            f"block placed on its own; default {DEFAULT_SEGMENT_BLOCKS}), got {blocks!r}"))
    if config.cluster.placement not in PLACEMENTS:
        raise ConfigError("cluster.placement", (
            "expected 'ring' (consistent-hash ring, the default) or 'rendezvous' "
            f"(highest-random-weight hashing), got {config.cluster.placement!r}"))
    if config.cluster.etcd is not None:
        check_etcd(config.cluster.etcd)
    k = config.cluster.prefix_blocks
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SEGMENT_BLOCKS:
        raise ConfigError("cluster.prefix_blocks", (
            f"expected a whole number of blocks >= 1 (more than the leading blocks every "
            f"prompt shares, e.g. a long system prompt; default 2), got {k!r}"))


def check_etcd(etcd: EtcdConfig) -> None:
    try:
        parse_etcd_url(etcd.url)
    except InvalidArgumentError as exc:
        raise ConfigError("cluster.etcd.url", str(exc)) from None
    if not 1 <= etcd.lease_ttl_s <= 3600:
        raise ConfigError("cluster.etcd.lease_ttl_s", "expected whole seconds from 1 to 3600 "
                          f"(how long a dead node stays a member), got {etcd.lease_ttl_s}")
    if (etcd.cert_file is None) != (etcd.key_file is None):
        raise ConfigError("cluster.etcd.cert_file", "a client certificate needs both "
                          "cert_file and key_file")
    if etcd.password is not None and etcd.user is None:
        raise ConfigError("cluster.etcd.user", "a password was given without a user")


def check_qos(qos: QosConfig) -> None:
    if not qos.read_p99_slo_ms > 0:
        raise ConfigError("qos.read_p99_slo_ms", "must be positive (milliseconds)")
    if qos.write_bandwidth_min <= 0:
        raise ConfigError("qos.write_bandwidth_min", "must be positive bytes per second "
                          "(e.g. 100MiB): the floor keeps checkpoints progressing")
    if qos.write_bandwidth_max is not None:
        if qos.write_bandwidth_max <= 0:
            raise ConfigError("qos.write_bandwidth_max", "must be positive bytes per second, "
                              "or null for no cap")
        if qos.write_bandwidth_min > qos.write_bandwidth_max:
            raise ConfigError(
                "qos.write_bandwidth_min",
                f"the floor ({qos.write_bandwidth_min} B/s) is above qos.write_bandwidth_max "
                f"({qos.write_bandwidth_max} B/s); lower the floor, raise the cap, or set "
                "write_bandwidth_max: null for no cap")
    if not qos.read_p99_window_s > 0:
        raise ConfigError("qos.read_p99_window_s", "must be positive (seconds)")
    if not 0 < qos.governor_period_s <= qos.read_p99_window_s:
        raise ConfigError("qos.governor_period_s", "must be positive and at most "
                          "qos.read_p99_window_s (seconds)")
    if not 0 < qos.decrease_factor < 1:
        raise ConfigError("qos.decrease_factor", "must be between 0 and 1 (0.5 halves the "
                          "rate on each cut)")
    if not 0 < qos.background_share <= 1:
        raise ConfigError("qos.background_share", "must be in (0, 1]")
    if qos.control == "aimd":
        raise ConfigError("qos.control", "the AIMD law was removed: its saw-tooth saved less "
                          "than the latency-target law at the same read p99 SLO; set "
                          "qos.control: target or delete the field")
    if qos.control not in CONTROL_LAWS:
        raise ConfigError("qos.control", f"must be one of {', '.join(CONTROL_LAWS)}, got "
                          f"{qos.control!r}")
