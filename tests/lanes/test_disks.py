"""The disk probe behind ``isolane lanes check``: mountinfo parsing, partitions, pairs."""

from __future__ import annotations

import os
from pathlib import Path

from isolane.config import DeviceGroupConfig, config_from_dict, shared_disks
from isolane.lanes.disks import (
    MountEntry,
    check_isolation,
    mount_of,
    parse_mountinfo,
    probe_device,
    read_mountinfo,
    whole_disk,
)

MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
36 27 259:2 / /mnt/nvme\\040fast rw,noatime shared:1 master:2 - xfs /dev/nvme0n1p2 rw
37 27 259:3 / /mnt/nvme0b rw,noatime - xfs /dev/nvme0n1p3 rw
38 36 0:45 / /mnt/nvme\\040fast/tmp rw - tmpfs tmpfs rw
garbage line without separator
"""


def test_mountinfo_fields_escapes_and_optional_fields() -> None:
    entries = parse_mountinfo(MOUNTINFO)
    assert len(entries) == 4  # the malformed line is skipped
    assert entries[1] == MountEntry("259:2", "/mnt/nvme fast", "xfs", "/dev/nvme0n1p2")
    assert entries[0].fs_type == "ext4" and entries[0].source == "/dev/vda"


def test_mount_of_picks_the_deepest_mount_of_the_same_device() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert mount_of("/mnt/nvme fast/ckpt", "259:2", mounts) == mounts[1]
    assert mount_of("/mnt/nvme fast/tmp/x", "0:45", mounts) == mounts[3]
    assert mount_of("/home/me", "254:0", mounts) == mounts[0]
    assert mount_of("/mnt/nvme0b2/x", "254:0", mounts) == mounts[0]  # not a prefix match
    # A btrfs subvolume reports its own st_dev: fall back to the deepest mount above.
    assert mount_of("/mnt/nvme0b/sub", "0:99", mounts) == mounts[2]


def sysfs(tmp_path: Path) -> str:
    """A stand-in /sys: nvme0n1 with partitions p2 and p3, and vda without any."""
    root = tmp_path / "sys"
    disk = root / "devices" / "pci0" / "nvme" / "block" / "nvme0n1"
    for part in ("nvme0n1p2", "nvme0n1p3"):
        (disk / part).mkdir(parents=True)
        (disk / part / "partition").write_text("2\n")
    (root / "devices" / "virtio" / "block" / "vda").mkdir(parents=True)
    links = root / "dev" / "block"
    links.mkdir(parents=True)
    (links / "259:2").symlink_to(disk / "nvme0n1p2")
    (links / "259:3").symlink_to(disk / "nvme0n1p3")
    (links / "254:0").symlink_to(root / "devices" / "virtio" / "block" / "vda")
    return str(root)


def test_partitions_resolve_to_their_whole_disk(tmp_path: Path) -> None:
    root = sysfs(tmp_path)
    assert whole_disk(259, 2, root) == whole_disk(259, 3, root) == "nvme0n1"
    assert whole_disk(254, 0, root) == "vda"
    assert whole_disk(0, 45, root) is None  # tmpfs: no block device


def test_probe_stats_the_nearest_existing_folder(tmp_path: Path) -> None:
    probe = probe_device(str(tmp_path / "not" / "yet"), read_mountinfo())  # [] off Linux
    st = os.stat(tmp_path)
    assert probe.probed == str(tmp_path) and not probe.remote
    assert probe.st_dev == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    assert probe.mount_point is not None and str(tmp_path).startswith(probe.mount_point)
    assert probe_device("s3://bucket/x", []).remote
    assert probe_device("s3://bucket/x", []).key is None


def test_pairs_are_found_whatever_the_group_order() -> None:
    groups = [DeviceGroupConfig("cold", "capacity", ("/d/cold",)),
              DeviceGroupConfig("ckpt", "write", ("/d/ckpt", "/e/ckpt")),
              DeviceGroupConfig("kv", "read", ("/e/kv",))]
    disk = {"/d/cold": "d", "/d/ckpt": "d", "/e/ckpt": "e", "/e/kv": "e"}.get
    pairs = [(a.name, b.name, key) for a, b, key in shared_disks(groups, disk)]
    assert pairs == [("cold", "ckpt", "d"), ("ckpt", "kv", "e")]


def test_check_reports_write_and_read_on_one_disk_but_not_others(tmp_path: Path) -> None:
    config = config_from_dict({"device_groups": {
        "ckpt": {"role": "write", "devices": [str(tmp_path / "w")]},
        "kv": {"role": "read", "devices": [str(tmp_path / "r")]},
        "cold": {"role": "capacity", "devices": ["s3://bucket/cold"]},
    }})
    report = check_isolation(config, mounts=[])
    assert not report.ok
    [shared] = report.shared
    assert (shared.first.name, shared.second.name) == ("ckpt", "kv")
    data = report.as_dict()
    assert data["warnings"][0].startswith("WARNING: write group 'ckpt' and read group 'kv'")
    assert data["groups"][2]["devices"][0]["remote"] is True
    assert data["groups"][0]["devices"][0]["fs_type"] == "?"  # no mountinfo: walked up
    # Only a write group and a capacity group on one disk: a note, not a warning.
    config = config_from_dict({"device_groups": {
        "ckpt": {"role": "write", "devices": [str(tmp_path / "w")]},
        "spill": {"role": "capacity", "devices": [str(tmp_path / "c")]},
    }})
    report = check_isolation(config, mounts=[])
    assert report.ok and report.as_dict()["notes"][0].startswith("note: write group 'ckpt'")
