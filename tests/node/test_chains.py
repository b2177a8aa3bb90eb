"""The node's chain index (file) and the chain list (wire): round trips, a torn tail,
damage, rewrites."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from isolane.errors import WireFormatError
from isolane.node.chains import FILE_HEADER, ChainIndex, decode_records, encode_record
from isolane.wire.chain_list import decode_chain_list, encode_chain_list


def _key(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def test_the_chain_list_round_trips_and_damage_is_refused() -> None:
    chains = [(_key("d", i), [_key(i, b) for b in range(i)]) for i in range(5)]
    body = encode_chain_list(chains)
    assert decode_chain_list(body) == chains
    assert decode_chain_list(encode_chain_list([])) == []
    flipped = bytearray(body)
    flipped[40] ^= 1
    with pytest.raises(WireFormatError, match="damaged"):
        decode_chain_list(bytes(flipped))
    with pytest.raises(WireFormatError):
        decode_chain_list(body[:10])


def test_the_index_keeps_new_keys_in_put_order_across_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "ns" / "chains.log"
    index = ChainIndex(path)
    a, b = _key("a"), _key("b")
    keys = [_key("k", i) for i in range(6)]
    assert index.add(a, keys[:3]) == 3
    assert index.add(a, keys[:4]) == 1  # a put of the longer prompt: one new key
    assert index.add(b, keys[4:]) == 2
    index.close()
    again = ChainIndex(path)
    stored = set(keys) - {keys[1]}
    assert again.chains(stored.__contains__) == [(a, [keys[0], keys[2], keys[3]]),
                                                 (b, keys[4:])]
    assert again.chains(lambda k: k in keys[4:]) == [(b, keys[4:])]  # a forgotten
    assert len(again) == 1
    again.close()


def test_a_torn_tail_is_cut_and_a_foreign_file_restarted(tmp_path: Path) -> None:
    path = tmp_path / "chains.log"
    index = ChainIndex(path)
    for i in range(4):
        index.add(_key("d", i), [_key(i, b) for b in range(3)])
    index.close()
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # a crash in the middle of the last record
    index = ChainIndex(path)
    assert [d for d, _ in index.chains(lambda k: True)] == [_key("d", i) for i in range(3)]
    index.add(_key("d", 9), [_key(9, 0)])  # appends after the cut, not after the garbage
    index.close()
    records, good = decode_records(path.read_bytes())
    assert good == path.stat().st_size and records[-1] == (_key("d", 9), [_key(9, 0)])
    path.write_bytes(b"not an index at all")
    assert ChainIndex(path).chains(lambda k: True) == []


def test_a_mostly_dead_index_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "chains.log"
    index = ChainIndex(path)
    for i in range(600):
        index.add(_key("d", i), [_key(i, b) for b in range(10)])
    big = path.stat().st_size
    live = {_key(0, b) for b in range(10)}
    assert index.chains(live.__contains__) == [(_key("d", 0), [_key(0, b) for b in range(10)])]
    assert path.stat().st_size == FILE_HEADER.size + len(encode_record(_key("d", 0),
                                                                      sorted(live))) < big
    index.close()
    assert len(ChainIndex(path)) == 1


def test_an_index_planted_as_a_link_is_replaced_its_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    index = ChainIndex(tmp_path / "model.log")  # a valid index with a torn tail
    index.add(_key("d", 0), [_key(0, 0), _key(0, 1)])
    index.close()
    precious = (tmp_path / "model.log").read_bytes() + b"torn tail"
    victim.write_bytes(precious)
    path = tmp_path / "ns" / "chains.log"
    path.parent.mkdir()
    path.symlink_to(victim)
    index = ChainIndex(path)
    index.add(_key("d", 1), [_key(1, 0)])
    index.close()
    assert victim.read_bytes() == precious  # not cut, not appended to
    assert not path.is_symlink()
    assert [d for d, _ in ChainIndex(path).chains(lambda k: True)] == [_key("d", 1)]
