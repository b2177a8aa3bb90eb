"""KV block keys: chained prefix hashes of token blocks (pure, no I/O).

A prompt's tokens are cut into blocks of ``chunk_tokens`` tokens; block ``i`` gets the
16-byte key

    key_0 = H(namespace.digest() || block_0)
    key_i = H(key_{i-1}          || block_i)

where ``block_i`` is its token ids as uint32 little-endian and ``H`` is BLAKE2b with
``digest_size=16`` (unkeyed, no salt, no personalisation). A key therefore names the
whole prefix up to the end of its block: two prompts share exactly the keys of the
blocks they share from the start, and a trailing partial block has no key (it is not
cached). The same tokens give the same keys in every process and on every host (no
Python ``hash()``); any language with BLAKE2b computes them too. The byte layout is
documented in ``docs/FORMATS.md`` ("KV block keys")::

    namespace encoding (hashed into namespace.digest()):
    +--------+--------------------+-----------------------------------------+
    | offset | size               | field                                   |
    +--------+--------------------+-----------------------------------------+
    | 0      | 16                 | magic b"isolane-kvns-v1\\x00"            |
    | 16     | 4 + len(model)     | u32le byte length, then model as UTF-8  |
    | ...    | 4 + len(dtype)     | u32le byte length, then dtype as UTF-8  |
    | ...    | 4 + len(layout)    | u32le byte length, then layout as UTF-8 |
    | ...    | 4                  | tp_rank, u32le                          |
    | ...    | 4                  | tp_size, u32le                          |
    +--------+--------------------+-----------------------------------------+

A request whose KV depends on more than its tokens (a LoRA adapter, multimodal inputs,
a ``cache_salt``) carries a ``KVContext``; its chain starts from
``H(context_magic || namespace.digest() || context.encode())`` instead of the namespace
digest (an empty context changes nothing), so such requests share blocks only with
requests of the same context.

Why BLAKE2b and not xxh3-128 (which the snapshot chunks use): keys decide which stored
KV a request is served, across tenants, so they must resist deliberately crafted
collisions (a non-cryptographic hash lets one prompt poison another's prefix). The price
is small: hashing the chain of 128k tokens in blocks of 256 takes ~0.8 ms with BLAKE2b
against ~0.1 ms with xxh3-128; ``block_keys`` as a whole takes ~0.9 ms from a numpy array
or tensor and ~1.6 ms from a list (converting the list costs more than the hash), far
below the prefill the keys save.
"""

from __future__ import annotations

import hashlib
import operator
import re
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt

from isolane.errors import ConfigError, InvalidArgumentError

if TYPE_CHECKING:
    import torch

KEY_BYTES = 16
"""Length of a block key (and of a namespace digest) in bytes."""
TOKEN_BYTES = 4
"""Each token id is hashed as an unsigned 32-bit little-endian integer."""
MAX_TOKEN_ID = 2**32 - 1
NAMESPACE_MAGIC = b"isolane-kvns-v1\x00"
CONTEXT_MAGIC = b"isolane-kvctx-v1"
"""Leads the seed of a chain with a request context (16 bytes, no terminator)."""
"""Leads the namespace encoding; a new key scheme changes it (and so every key)."""
HASH_NAME = "blake2b-128"
"""BLAKE2b with ``digest_size=16``: what ``H`` is in the key chain."""

_U32 = struct.Struct("<I")
_U32_MAX = 2**32 - 1
_HEX_KEY = re.compile(r"[0-9a-f]{32}")
# array('I') is the fastest way from a list of ints to uint32 bytes; use it only where
# it is exactly uint32 (the common case) and fall back to numpy elsewhere.
_ARRAY_U32 = array("I").itemsize == TOKEN_BYTES
_BIG_ENDIAN = sys.byteorder == "big"

TokenIds: TypeAlias = "Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor"


def _hash(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


@dataclass(frozen=True)
class KVNamespace:
    """What a KV block's bytes depend on besides the tokens; keys never cross namespaces.

    ``model`` names the weights (e.g. ``"meta-llama/Llama-3.1-8B-Instruct@<revision>"``),
    ``dtype`` the KV element type (``"bfloat16"``), ``layout`` the engine's block layout
    (e.g. ``"vllm:[2,L,B,H,D]"``), and ``tp_rank``/``tp_size`` the tensor-parallel shard.
    Strings are hashed exactly as given (UTF-8, no normalisation): producers and
    consumers must agree on them byte for byte. Invalid fields raise ``ConfigError``
    naming the field.
    """

    model: str
    dtype: str
    layout: str
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"namespace.{name}", f"expected text, got {value!r}")
            if not value or value != value.strip():
                raise ConfigError(f"namespace.{name}", "expected non-empty text without "
                                  f"leading or trailing whitespace, got {value!r}")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ConfigError(f"namespace.{name}",
                                  f"{value!r} is not valid Unicode text") from None
        for name in ("tp_rank", "tp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"namespace.{name}", f"expected a whole number, got {value!r}")
        if not 1 <= self.tp_size <= _U32_MAX:
            raise ConfigError("namespace.tp_size", f"expected 1 <= tp_size < 2**32, "
                              f"got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError("namespace.tp_rank", f"expected 0 <= tp_rank < tp_size "
                              f"({self.tp_size}), got {self.tp_rank}")

    def encode(self) -> bytes:
        """The canonical bytes of this namespace (layout in the module docstring)."""
        parts = [NAMESPACE_MAGIC]
        for name in ("model", "dtype", "layout"):
            raw = str(getattr(self, name)).encode("utf-8")
            parts += [_U32.pack(len(raw)), raw]
        parts += [_U32.pack(self.tp_rank), _U32.pack(self.tp_size)]
        return b"".join(parts)

    def digest(self) -> bytes:
        """BLAKE2b-128 of :meth:`encode`: the 16 bytes that seed every key chain
        (computed once: every ``block_keys`` call starts from it)."""
        digest: bytes | None = self.__dict__.get("_digest")
        if digest is None:
            digest = _hash(self.encode())
            object.__setattr__(self, "_digest", digest)  # frozen: fields only
        return digest


_CTX_LORA, _CTX_SALT, _CTX_MM, _CTX_ADAPTER = 1, 2, 3, 4
_U64 = struct.Struct("<Q")
_MAX_CONTEXT_TEXT = 4096


@dataclass(frozen=True)
class KVContext:
    """What besides the tokens a request's KV depends on, within one namespace: the
    LoRA adapter (vLLM's name and path), a ``cache_salt`` (tenant isolation), the
    multimodal inputs (each item's hash and its token position and length, as vLLM's
    ``mm_features`` give them) and a transformers PEFT adapter (its name and a digest
    of its weights). vLLM's own prefix hash covers the same inputs. Empty by default:
    an empty context gives the namespace's plain keys."""

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_items: tuple[tuple[str, int, int], ...] = ()
    adapter: str | None = None

    def __post_init__(self) -> None:
        for name in ("lora_name", "lora_path", "cache_salt", "adapter"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str)
                                      or len(value) > _MAX_CONTEXT_TEXT):
                raise InvalidArgumentError(
                    f"KVContext.{name} must be text of at most {_MAX_CONTEXT_TEXT} "
                    f"characters, got {value!r:.80}")
        for item in self.mm_items:
            if (not isinstance(item, tuple) or len(item) != 3 or not isinstance(item[0], str)
                    or len(item[0]) > _MAX_CONTEXT_TEXT
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                           for v in item[1:])):
                raise InvalidArgumentError(
                    "KVContext.mm_items must hold (hash text, offset >= 0, length >= 0) "
                    f"tuples, got {item!r:.80}")

    def __bool__(self) -> bool:
        return bool(self.lora_name or self.lora_path or self.cache_salt or self.mm_items
                    or self.adapter)

    def encode(self) -> bytes:
        """Canonical bytes (docs/FORMATS.md, "Request context"): a u32le field count,
        then per field a u8 tag and its values (text: u32le length + UTF-8; numbers:
        u64le), in the order lora, cache_salt, multimodal items, adapter."""
        fields: list[bytes] = []
        if self.lora_name is not None or self.lora_path is not None:
            fields.append(bytes([_CTX_LORA]) + _text(self.lora_name or "")
                          + _text(self.lora_path or ""))
        if self.cache_salt:
            fields.append(bytes([_CTX_SALT]) + _text(self.cache_salt))
        for identifier, offset, length in self.mm_items:
            fields.append(bytes([_CTX_MM]) + _text(identifier) + _U64.pack(offset)
                          + _U64.pack(length))
        if self.adapter is not None:
            fields.append(bytes([_CTX_ADAPTER]) + _text(self.adapter))
        return _U32.pack(len(fields)) + b"".join(fields)


def _text(value: str) -> bytes:
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{value!r:.80} is not valid Unicode text") from None
    return _U32.pack(len(raw)) + raw


def chain_seed(namespace: KVNamespace, context: KVContext | None = None) -> bytes:
    """The 16 bytes a key chain starts from: the namespace digest, or for a non-empty
    context ``H(CONTEXT_MAGIC || namespace.digest() || context.encode())``."""
    if not context:
        return namespace.digest()
    return _hash(CONTEXT_MAGIC + namespace.digest() + context.encode())


def block_keys(token_ids: TokenIds, chunk_tokens: int, namespace: KVNamespace,
               context: KVContext | None = None) -> list[bytes]:
    """The key of every whole block of ``chunk_tokens`` tokens of ``token_ids``, in order.

    ``token_ids`` is a sequence of ints, or a 1-D integer numpy array or torch tensor
    (any device; it is copied to the CPU). Ids must lie in ``[0, 2**32)``. A trailing
    partial block gets no key, so fewer than ``chunk_tokens`` tokens give ``[]``.
    The keys of a prefix of ``token_ids`` are a prefix of these keys. A non-empty
    ``context`` gives keys of their own (see ``chain_seed``).

    Raises ``InvalidArgumentError`` naming the argument (and the position of a bad id).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise InvalidArgumentError(
            f"chunk_tokens must be a whole number >= 1 (kvpool.chunk_tokens), got {chunk_tokens!r}")
    if not isinstance(namespace, KVNamespace):
        raise InvalidArgumentError(
            f"namespace must be a KVNamespace, got {type(namespace).__name__}")
    if context is not None and not isinstance(context, KVContext):
        raise InvalidArgumentError(
            f"context must be a KVContext or None, got {type(context).__name__}")
    data = memoryview(token_bytes(token_ids))
    step = chunk_tokens * TOKEN_BYTES
    keys: list[bytes] = []
    key = chain_seed(namespace, context)
    for start in range(0, len(data) - step + 1, step):
        h = hashlib.blake2b(key, digest_size=KEY_BYTES)
        h.update(data[start:start + step])
        key = h.digest()
        keys.append(key)
    return keys


def token_bytes(token_ids: TokenIds) -> bytes:
    """``token_ids`` as consecutive uint32 little-endian values (what the keys hash)."""
    torch_mod = sys.modules.get("torch")  # a tensor implies torch is imported already
    if torch_mod is not None and isinstance(token_ids, torch_mod.Tensor):
        return _tensor_bytes(token_ids)
    if isinstance(token_ids, np.ndarray):
        return _ndarray_bytes(token_ids, "a numpy array")
    if isinstance(token_ids, (str, bytes, bytearray, memoryview)) or not isinstance(
            token_ids, Sequence):
        raise InvalidArgumentError(
            "token_ids must be a sequence of ints, a 1-D integer numpy array or a torch "
            f"tensor, got {type(token_ids).__name__}")
    return _sequence_bytes(token_ids)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    dtype = tensor.dtype
    if dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
        raise InvalidArgumentError(
            f"token_ids must be an integer tensor, got dtype {str(dtype).removeprefix('torch.')}")
    if tensor.dim() != 1:
        raise InvalidArgumentError(
            f"token_ids must be a 1-D tensor, got shape {tuple(tensor.shape)}")
    return _ndarray_bytes(tensor.detach().cpu().numpy(), "a tensor")


def _ndarray_bytes(arr: npt.NDArray[Any], what: str) -> bytes:
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"token_ids must be {what} of integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"token_ids must be 1-D, got shape {arr.shape}")
    signed = arr.dtype.kind == "i"
    if arr.size and (signed or arr.dtype.itemsize > TOKEN_BYTES):
        bad = arr < 0 if signed else np.zeros(arr.shape, dtype=bool)
        if arr.dtype.itemsize > TOKEN_BYTES:
            bad |= arr > MAX_TOKEN_ID
        positions = np.flatnonzero(bad)
        if positions.size:
            pos = int(positions[0])
            raise _bad_id(pos, int(arr[pos]))
    return arr.astype("<u4", copy=False).tobytes()


def _sequence_bytes(seq: Sequence[int]) -> bytes:
    if _ARRAY_U32:
        try:
            packed = array("I", seq)
        except (OverflowError, TypeError):
            pass  # find and name the offending position below
        else:
            if _BIG_ENDIAN:
                packed.byteswap()
            return packed.tobytes()
    values: list[int] = []
    for pos, value in enumerate(seq):
        try:
            number = operator.index(value)
        except TypeError:
            raise InvalidArgumentError(
                f"token_ids[{pos}] must be an integer token id, got {value!r}") from None
        if not 0 <= number <= MAX_TOKEN_ID:
            raise _bad_id(pos, number)
        values.append(number)
    return np.asarray(values, dtype="<u4").tobytes()


def _bad_id(pos: int, value: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"token_ids[{pos}] = {value} is not a valid token id: ids are hashed as uint32, "
        f"so they must lie in [0, {MAX_TOKEN_ID}]")


def check_keys(keys: Sequence[Any]) -> Sequence[bytes]:
    """``keys`` when every one is a block key: bytes-like (``bytes``, ``bytearray``,
    ``memoryview``) of ``KEY_BYTES`` bytes, as ``block_keys`` returns. Anything else is
    an InvalidArgumentError naming the first bad key (an int is never taken for
    ``bytes(int)`` zeros, which would make every int key of one value collide)."""
    for i, key in enumerate(keys):
        if type(key) is bytes and len(key) == KEY_BYTES:
            continue
        if isinstance(key, bytearray | memoryview) and memoryview(key).nbytes == KEY_BYTES:
            continue
        raise InvalidArgumentError(
            f"KV block key {i} is {key!r:.60} ({type(key).__name__}); a key is "
            f"{KEY_BYTES} bytes (bytes, bytearray or memoryview), as block_keys() "
            "returns; nothing was done")
    return keys


def key_hex(key: bytes) -> str:
    """A key as 32 lowercase hex characters (for URLs and logs)."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise InvalidArgumentError(
            f"a KV block key is {KEY_BYTES} bytes, got {key!r:.80}")
    return bytes(key).hex()


def key_from_hex(text: str) -> bytes:
    """The key whose :func:`key_hex` is ``text``; only exactly 32 lowercase hex chars."""
    if not isinstance(text, str) or _HEX_KEY.fullmatch(text) is None:
        raise InvalidArgumentError(
            f"a KV block key is written as {2 * KEY_BYTES} lowercase hex characters, "
            f"got {text!r:.80}")
    return bytes.fromhex(text)
