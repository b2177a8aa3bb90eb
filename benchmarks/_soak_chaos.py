"""The soak's faults: flipped bytes in chunk, manifest and segment files, a full disk,
planted symlinks, and the canary tree that must come out of it all unchanged.

Each fault returns a record (JSON-able) of exactly what it damaged, so that the final
check can tell a deliberately damaged snapshot or block from a lost one: a flipped
chunk is recorded by inode (hard-linked chunks of incremental saves share it), offset
and the byte written; a flipped KV record by the key of the record it hit.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import struct
import subprocess
from pathlib import Path
from typing import Any

SEGMENT_HEADER_BYTES_AT = 10  # uint16: where the first record starts
RECORD_HEADER = struct.Struct("<QBBHIQ")  # checksum, flags, reserved, key_len, value_len, ts
RECORD_ALIGN = 64
MANIFEST = "isolane.json"
NOT_CHUNKS = {MANIFEST, "zarr.json", "_writing.json", "isolane.part.json"}


def _align(n: int) -> int:
    return -(-n // RECORD_ALIGN) * RECORD_ALIGN


def regular_files(root: Path) -> list[Path]:
    """Regular files under ``root`` (never through a symlink), sorted."""
    out = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        for f in files:
            p = Path(folder) / f
            try:
                if p.is_symlink() or not p.is_file():
                    continue
            except OSError:
                continue
            out.append(p)
        dirs.sort()
    return sorted(out)


def snapshot_files(roots: list[Path]) -> tuple[list[Path], list[Path]]:
    """(chunk files, manifests) under the ``snapshots`` folder of each root."""
    chunks, manifests = [], []
    for root in roots:
        for p in regular_files(root / "snapshots"):
            if p.name == MANIFEST:
                manifests.append(p)
            elif p.name not in NOT_CHUNKS and not p.name.endswith(".tmp"):
                chunks.append(p)
    return chunks, manifests


def segment_files(roots: list[Path]) -> list[Path]:
    return [p for root in roots for p in regular_files(root / "kvpool")
            if p.suffix in (".live", ".sealed")]


def _flip_at(path: Path, offset: int, mask: int) -> dict[str, Any]:
    st = os.lstat(path)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        old = os.pread(fd, 1, offset)
        if len(old) != 1:
            raise OSError(errno.EINVAL, f"{path} has no byte at {offset}")
        new = old[0] ^ mask
        os.pwrite(fd, bytes([new]), offset)
    finally:
        os.close(fd)
    return {"path": str(path), "dev": st.st_dev, "ino": st.st_ino, "offset": offset,
            "byte": new}


def flip_chunk(rng: random.Random, roots: list[Path]) -> dict[str, Any] | None:
    chunks, _ = snapshot_files(roots)
    chunks = [p for p in chunks if _size(p) > 0]
    if not chunks:
        return None
    path = rng.choice(chunks)
    return {"kind": "chunk", **_flip_at(path, rng.randrange(_size(path)), 0xFF)}


def flip_manifest_digit(rng: random.Random, roots: list[Path]) -> dict[str, Any] | None:
    """Change one digit of a manifest (``0`` <-> ``1``, ...): still valid JSON, the
    damage that only a checksum of the manifest itself catches."""
    _, manifests = snapshot_files(roots)
    rng.shuffle(manifests)
    for path in manifests[:5]:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        digits = [i for i, b in enumerate(data) if 0x30 <= b <= 0x39]
        if digits:
            return {"kind": "manifest", **_flip_at(path, rng.choice(digits), 0x01)}
    return None


def segment_records(path: Path) -> list[tuple[int, int, int, bytes]]:
    """(record offset, value offset, value length, key) of each put record, walked by
    the documented framing (no checksum check: the soak only needs to aim)."""
    data = path.read_bytes()
    if len(data) < 64:
        return []
    pos = int.from_bytes(data[SEGMENT_HEADER_BYTES_AT:SEGMENT_HEADER_BYTES_AT + 2], "little")
    out = []
    while pos + RECORD_HEADER.size <= len(data):
        _csum, flags, _res, klen, vlen, _ts = RECORD_HEADER.unpack_from(data, pos)
        if flags not in (1, 2) or not 0 < klen <= 1024:
            break
        delta = _align(RECORD_HEADER.size + klen)
        end = pos + _align(delta + vlen)
        if end > len(data):
            break
        if flags == 1 and vlen:
            key = data[pos + RECORD_HEADER.size:pos + RECORD_HEADER.size + klen]
            out.append((pos, pos + delta, vlen, key))
        pos = end
    return out


def flip_segment(rng: random.Random, roots: list[Path]) -> dict[str, Any] | None:
    """Flip one byte inside the value of a random KV record; records its key."""
    files = segment_files(roots)
    rng.shuffle(files)
    for path in files[:5]:
        try:
            records = segment_records(path)
        except OSError:
            continue
        if not records:
            continue
        _start, value_at, vlen, key = rng.choice(records)
        return {"kind": "segment", "key": key.hex(),
                **_flip_at(path, value_at + rng.randrange(vlen), 0xFF)}
    return None


def plant_symlink(rng: random.Random, roots: list[Path], canary: Path, n: int
                  ) -> dict[str, Any] | None:
    """A symlink into the canary tree where the store deletes: as a snapshot name, or
    inside a snapshot's generation folder."""
    targets = sorted(p for p in canary.iterdir() if p.is_dir())
    root = rng.choice(roots)
    snaps = root / "snapshots"
    if not snaps.is_dir() or not targets:
        return None
    target = rng.choice(targets)
    gens = [g for s in sorted(snaps.iterdir()) if s.is_dir() and not s.is_symlink()
            for g in sorted(s.iterdir()) if g.is_dir() and not g.is_symlink()]
    if gens and rng.random() < 0.5:
        link = rng.choice(gens) / f"planted-{n}"
    else:
        link = snaps / f"planted-{n}"
    try:
        link.symlink_to(target, target_is_directory=True)
    except OSError:
        return None
    return {"kind": "symlink", "path": str(link), "target": str(target)}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# -- a full disk ----------------------------------------------------------------------------
def mount_tmpfs(folder: Path, size_mib: int) -> str | None:
    """Mount a tmpfs of ``size_mib`` at ``folder``; None on success, else why not."""
    folder.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700",
                          "tmpfs", str(folder)], capture_output=True, text=True)
    if run.returncode != 0:
        return (run.stderr or run.stdout).strip() or f"mount exited {run.returncode}"
    return None


def unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


def fill_disk(folder: Path, name: str) -> int:
    """Write ``folder/name`` until the device says ENOSPC; returns the bytes written."""
    path = folder / name
    written = 0
    block = b"\xa5" * (1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            try:
                n = os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(block) == 1:
                    return written
                block = block[:len(block) // 2]
                continue
            written += n
    finally:
        os.close(fd)


# -- the canary -----------------------------------------------------------------------------
def make_canary(folder: Path, seed: int) -> None:
    """Folders of files beside the stores: the soak's symlinks point into them."""
    rng = random.Random(seed)
    for d in range(4):
        sub = folder / f"dir{d}"
        (sub / "nested").mkdir(parents=True, exist_ok=True)
        for f in range(3):
            (sub / f"file{f}.bin").write_bytes(rng.randbytes(rng.randint(1, 5000)))
        (sub / "nested" / "deep.txt").write_text(f"canary {d}\n")
        (sub / "isolane.json").write_text('{"looks": "like a manifest"}')
    (folder / "top.txt").write_text("canary top\n")


def tree_digest(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed) -> type and content hash."""
    out: dict[str, str] = {}
    for base, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            p = Path(base) / name
            rel = str(p.relative_to(folder))
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = f"dir:{st.st_mode:o}"
            else:
                out[rel] = f"file:{st.st_mode:o}:" + hashlib.sha256(p.read_bytes()).hexdigest()
    return out
