"""The range checks of a parsed config (pure: no I/O): each refusal names the field,
what it accepts and, where it helps, the way out. ``isolane.config`` runs
``check_config`` on every Config it builds; the device groups are checked there (they
touch the filesystem).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from isolane.bounded_json import DEPTH_CEILING as MAX_JSON_DEPTH
from isolane.cluster.chain_segments import DEFAULT_SEGMENT_BLOCKS, MAX_SEGMENT_BLOCKS
from isolane.cluster.rendezvous import PLACEMENTS
from isolane.errors import ConfigError, InvalidNameError
from isolane.kvpool.namespaces import check_namespace

if TYPE_CHECKING:
    from isolane.config import Config, QosConfig

CONTROL_LAWS = ("target", "aimd")


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
    if config.kvpool.policy not in ("s3fifo", "lru", "wtinylfu"):
        raise ConfigError("kvpool.policy", "expected s3fifo, lru or wtinylfu, got "
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
                "max_header_bytes"):
        if getattr(config.node, cap) < 1:
            raise ConfigError(f"node.{cap}", "must be at least 1")
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
    k = config.cluster.prefix_blocks
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SEGMENT_BLOCKS:
        raise ConfigError("cluster.prefix_blocks", (
            f"expected a whole number of blocks >= 1 (more than the leading blocks every "
            f"prompt shares, e.g. a long system prompt; default 2), got {k!r}"))


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
    if qos.write_bandwidth_step <= 0:
        raise ConfigError("qos.write_bandwidth_step", "must be positive bytes per second")
    if not 0 < qos.decrease_factor < 1:
        raise ConfigError("qos.decrease_factor", "must be between 0 and 1 (0.5 halves the "
                          "rate on each cut)")
    if not 0 < qos.background_share <= 1:
        raise ConfigError("qos.background_share", "must be in (0, 1]")
    if qos.control not in CONTROL_LAWS:
        raise ConfigError("qos.control", f"must be one of {', '.join(CONTROL_LAWS)}, got "
                          f"{qos.control!r}")
