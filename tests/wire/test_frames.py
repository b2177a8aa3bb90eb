"""KV wire format (pure): round trips, truncation, damage and limits."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from isolane.client.kv_pool import read_batch
from isolane.errors import PayloadTooLargeError, WireFormatError
from isolane.wire import frames

keys_st = st.lists(st.binary(min_size=16, max_size=16), min_size=0, max_size=20, unique=True)


def _batch(pairs: list[tuple[bytes, bytes | None]]) -> bytes:
    parts: list[bytes] = [frames.encode_batch_header(len(pairs))]
    for key, value in pairs:
        parts.extend(bytes(p) for p in frames.encode_frame(key, value))
    return b"".join(parts)


@given(keys_st, st.data())
def test_a_batch_reads_back_value_for_value(keys: list[bytes], data: st.DataObject) -> None:
    values = [data.draw(st.one_of(st.none(), st.binary(max_size=300))) for _ in keys]
    got, complete = read_batch(io.BytesIO(_batch(list(zip(keys, values, strict=True)))),
                               keys, 1024)
    assert complete
    # An empty value is sent as a value (status 1), not as a miss.
    assert got == values


class _Trickle:
    """A body that arrives in pieces of the sizes drawn (short reads, as a socket)."""

    def __init__(self, body: bytes, sizes: list[int]) -> None:
        self.body, self.sizes, self.at = body, sizes or [1], 0

    def read(self, amt: int) -> bytes:
        size = min(amt, self.sizes[self.at % len(self.sizes)])
        out = self.body[self.at:self.at + size]
        self.at += len(out)
        return out


@pytest.mark.parametrize("max_value_bytes", [1024, 1 << 20])  # pieces, or value by value
@given(keys=keys_st, data=st.data())
def test_short_reads_and_either_read_mode_give_the_same_values(
        max_value_bytes: int, keys: list[bytes], data: st.DataObject) -> None:
    values = [data.draw(st.one_of(st.none(), st.binary(max_size=300))) for _ in keys]
    body = _batch(list(zip(keys, values, strict=True)))
    sizes = data.draw(st.lists(st.integers(1, 700), max_size=5))
    got, complete = read_batch(_Trickle(body, sizes), keys, max_value_bytes)
    assert complete and got == values
    cut = data.draw(st.integers(0, len(body)))
    got, complete = read_batch(_Trickle(body[:cut], sizes), keys, max_value_bytes)
    assert complete == (cut == len(body)) and got[:len(keys)] == [
        v if g is not None else None for v, g in zip(values, got, strict=True)]


@given(keys_st.filter(bool), st.data())
def test_a_body_cut_anywhere_keeps_the_whole_frames_before_the_cut(
        keys: list[bytes], data: st.DataObject) -> None:
    values = [data.draw(st.binary(min_size=1, max_size=64)) for _ in keys]
    body = _batch(list(zip(keys, values, strict=True)))
    cut = data.draw(st.integers(0, len(body) - 1))
    got, complete = read_batch(io.BytesIO(body[:cut]), keys, 1024)
    assert not complete
    whole = 0  # frames that end at or before the cut
    end = frames.BATCH_HEADER.size
    for value in values:
        end += frames.FRAME_HEADER.size + len(value) + frames.CHECKSUM.size
        if end <= cut:
            whole += 1
    assert got == values[:whole] + [None] * (len(keys) - whole)


def test_a_flipped_value_byte_is_a_checksum_error() -> None:
    key = bytes(range(16))
    body = bytearray(_batch([(key, b"kv block bytes")]))
    body[frames.BATCH_HEADER.size + frames.FRAME_HEADER.size + 3] ^= 0x01
    with pytest.raises(WireFormatError, match="checksum mismatch"):
        read_batch(io.BytesIO(bytes(body)), [key], 1024)


def test_an_answer_for_other_keys_is_refused() -> None:
    body = _batch([(b"a" * 16, b"x")])
    with pytest.raises(WireFormatError, match="asked for"):
        read_batch(io.BytesIO(body), [b"b" * 16], 1024)


def test_headers_check_magic_version_and_limits() -> None:
    with pytest.raises(WireFormatError, match="not a KV batch"):
        frames.decode_batch_header(b"ISOSNAPS" + bytes(8), 10)
    with pytest.raises(WireFormatError, match="version 2"):
        frames.decode_batch_header(frames.BATCH_HEADER.pack(frames.BATCH_MAGIC, 2, 0, 1), 10)
    with pytest.raises(PayloadTooLargeError, match="11 blocks"):
        frames.decode_batch_header(frames.encode_batch_header(11), 10)
    head, _value, _sum = frames.encode_frame(b"k" * 16, b"v" * 100)
    with pytest.raises(PayloadTooLargeError, match="100 bytes"):
        frames.decode_frame_header(head, 99)
    assert frames.decode_frame_header(head, 100).length == 100


def test_key_lists_are_whole_keys() -> None:
    keys = [bytes([i]) * 16 for i in range(3)]
    assert frames.decode_keys(frames.encode_keys(keys)) == keys
    with pytest.raises(WireFormatError, match="not a multiple of 16"):
        frames.decode_keys(b"x" * 17)
