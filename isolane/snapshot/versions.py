"""Which tensors are unchanged since they were last saved, without reading them.

``change_detection="version"`` trusts torch's version counter: every in-place op on a
tensor (``add_``, ``copy_``, optimizer steps) bumps ``t._version``. A tensor object
that is still alive, at the same address and with the same version as when a saved
snapshot recorded its chunk hashes, is taken as unchanged and its chunks are linked
from that snapshot without hashing a byte. Writes that bypass the counter
(``t.data.add_()``, writes through ``t.numpy()``, CUDA kernels on raw pointers) are
invisible to it: that is why ``"hash"`` stays the default.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

Signature = tuple[Any, ...]


def signature(t: torch.Tensor) -> Signature | None:
    """Version and layout of ``t``; None when it has no version counter (inference mode)."""
    try:
        version = t._version
    except RuntimeError:
        return None
    return (version, t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            t.device)


@dataclass(frozen=True)
class _Seen:
    ref: weakref.ReferenceType[torch.Tensor]
    signature: Signature
    generation: str
    hashes: tuple[str, ...]


class TensorVersions:
    """Chunk hashes of tensors as last saved, keyed by tensor identity. Thread-safe.

    A freed tensor's record goes on the next call: its weakref callback only notes the
    key (``deque.append`` takes no lock). The callback may run inside this object's own
    locked section — the garbage collector runs at any allocation, and replacing a
    record can free the last reference to another remembered tensor — so a callback that
    took the lock would wait for itself for ever."""

    def __init__(self) -> None:
        self._seen: dict[int, _Seen] = {}
        self._freed: deque[int] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._drop_freed()
            return len(self._seen)

    def unchanged(self, t: torch.Tensor, sig: Signature | None, generation: str
                  ) -> tuple[str, ...] | None:
        """The chunk hashes recorded for ``t`` in ``generation``, if ``t`` is unchanged."""
        if sig is None:
            return None
        with self._lock:
            self._drop_freed()
            seen = self._seen.get(id(t))
        if (seen is None or seen.ref() is not t or seen.signature != sig
                or seen.generation != generation):
            return None
        return seen.hashes

    def remember(self, t: torch.Tensor, sig: Signature | None, generation: str,
                 hashes: tuple[str, ...]) -> None:
        if sig is None:
            return
        freed, key = self._freed, id(t)

        def note_freed(_ref: object) -> None:
            freed.append(key)

        ref = weakref.ref(t, note_freed)
        with self._lock:
            self._drop_freed()
            self._seen[key] = _Seen(ref, sig, generation, hashes)

    def _drop_freed(self) -> None:
        """Under the lock: forget the tensors freed since the last call (a key whose
        record is a newer tensor at the same address stays)."""
        while self._freed:
            key = self._freed.popleft()
            seen = self._seen.get(key)
            if seen is not None and seen.ref() is None:
                del self._seen[key]
