"""Which physical disk each device sits on: the check behind ``isolane lanes check``.

Lanes isolate threads and budgets; only separate disks isolate the I/O itself. For
every local device the probe finds the nearest existing folder, its ``st_dev``, the
mount point and filesystem (``/proc/self/mountinfo``; without it, walking up while
``st_dev`` stays the same) and the whole disk under a partition
(``/sys/dev/block/MAJ:MIN``), so two groups on two partitions of one NVMe drive are
reported as sharing it. URL devices are remote: no local disk.

Parsing mountinfo and judging the pairs are pure; ``probe_device`` and
``check_isolation`` do the I/O.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from isolane.config import Config, DeviceGroupConfig, is_url, shared_disks

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class MountEntry:
    dev: str  # "major:minor", as st_dev of files on it
    mount_point: str
    fs_type: str
    source: str


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """``/proc/self/mountinfo`` lines -> entries (malformed lines are skipped)."""
    entries = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        entries.append(MountEntry(dev=fields[2], mount_point=_unescape(fields[4]),
                                  fs_type=tail[0], source=_unescape(tail[1])))
    return entries


def _under(path: str, folder: str) -> bool:
    return folder == "/" or path == folder or path.startswith(folder.rstrip("/") + "/")


def mount_of(path: str, dev: str, mounts: list[MountEntry]) -> MountEntry | None:
    """The mount holding ``path``: the deepest mount point above it, preferring those
    of its own device (btrfs subvolumes report another st_dev than their mount)."""
    above = [m for m in mounts if _under(path, m.mount_point)]
    same = [m for m in above if m.dev == dev] or above
    return max(same, key=lambda m: len(m.mount_point), default=None)


@dataclass(frozen=True)
class DeviceDisk:
    """Where one configured device lives. ``disk`` is the whole block device
    (``nvme0n1`` for ``nvme0n1p2``), None for virtual filesystems (tmpfs, overlay)."""

    device: str
    remote: bool = False
    probed: str | None = None  # the nearest existing folder, which was stat'ed
    st_dev: str | None = None  # "major:minor"
    mount_point: str | None = None
    fs_type: str | None = None
    source: str | None = None
    disk: str | None = None

    @property
    def key(self) -> str | None:
        """What two devices must share to be on one disk (None: remote)."""
        if self.remote:
            return None
        return f"disk {self.disk}" if self.disk else f"st_dev {self.st_dev}"

    def describe(self) -> str:
        if self.remote:
            return "remote (object storage: no local disk)"
        where = f"{self.fs_type} {self.source} mounted at {self.mount_point}"
        if self.disk:
            return f"disk {self.disk} ({self.st_dev}; {where})"
        return f"no block device ({self.st_dev}; {where})"


def whole_disk(major: int, minor: int, sys_root: str = "/sys") -> str | None:
    """The disk a block device belongs to: itself, or the parent of a partition."""
    link = Path(sys_root) / "dev" / "block" / f"{major}:{minor}"
    try:
        real = link.resolve(strict=True)
    except OSError:
        return None  # no block device behind it (tmpfs, overlay, NFS)
    return real.parent.name if (real / "partition").exists() else real.name


def probe_device(device: str, mounts: list[MountEntry], sys_root: str = "/sys") -> DeviceDisk:
    """Stat the device (or its nearest existing ancestor) and name its mount and disk."""
    if is_url(device):
        return DeviceDisk(device, remote=True)
    probe = Path(os.path.realpath(device))
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    st = probe.stat()
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    dev = f"{major}:{minor}"
    entry = mount_of(str(probe), dev, mounts)
    if entry is not None:
        mount_point, fs_type, source = entry.mount_point, entry.fs_type, entry.source
    else:  # no mountinfo (not Linux): the topmost folder on the same st_dev
        top = probe
        while top.parent != top and top.parent.stat().st_dev == st.st_dev:
            top = top.parent
        mount_point, fs_type, source = str(top), "?", "?"
    return DeviceDisk(device, probed=str(probe), st_dev=dev, mount_point=mount_point,
                      fs_type=fs_type, source=source, disk=whole_disk(major, minor, sys_root))


def read_mountinfo(path: str = MOUNTINFO) -> list[MountEntry]:
    try:
        return parse_mountinfo(Path(path).read_text())
    except OSError:
        return []


@dataclass(frozen=True)
class SharedDisk:
    first: DeviceGroupConfig
    second: DeviceGroupConfig
    disk: str

    @property
    def isolation_broken(self) -> bool:
        """A write and a read group on one disk: checkpoints compete with KV reads."""
        return {self.first.role, self.second.role} == {"write", "read"}

    def message(self) -> str:
        pair = (f"{self.first.role} group '{self.first.name}' and {self.second.role} group "
                f"'{self.second.name}' share {self.disk}")
        if self.isolation_broken:
            return (f"WARNING: {pair}: checkpoint writes and KV reads compete for one "
                    "device, so the lanes isolate only threads and budgets and read "
                    "latency rests on the governor (qos.read_p99_slo_ms); put the groups "
                    "on separate disks")
        return f"note: {pair}"


@dataclass(frozen=True)
class IsolationReport:
    groups: list[tuple[DeviceGroupConfig, list[DeviceDisk]]]
    shared: list[SharedDisk]

    @property
    def ok(self) -> bool:
        return not any(s.isolation_broken for s in self.shared)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "groups": [{"name": g.name, "role": g.role,
                        "devices": [{**asdict(d), "key": d.key, "where": d.describe()}
                                    for d in disks]}
                       for g, disks in self.groups],
            "shared": [{"groups": [s.first.name, s.second.name],
                        "roles": [s.first.role, s.second.role], "disk": s.disk,
                        "isolation_broken": s.isolation_broken} for s in self.shared],
            "warnings": [s.message() for s in self.shared if s.isolation_broken],
            "notes": [s.message() for s in self.shared if not s.isolation_broken],
        }


def check_isolation(config: Config, *, mounts: list[MountEntry] | None = None,
                    sys_root: str = "/sys") -> IsolationReport:
    """Probe every device of every group and pair the groups that share a disk."""
    mounts = read_mountinfo() if mounts is None else mounts
    probed = {d: probe_device(d, mounts, sys_root)
              for g in config.device_groups.values() for d in g.devices}
    groups = [(g, [probed[d] for d in g.devices]) for g in config.device_groups.values()]
    pairs = shared_disks(config.device_groups.values(), lambda d: probed[d].key)
    return IsolationReport(groups, [SharedDisk(a, b, disk) for a, b, disk in pairs])
