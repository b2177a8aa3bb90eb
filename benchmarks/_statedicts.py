"""Synthetic training state dicts for the checkpoint benchmarks, and how to check them.

A state dict is planned as data (``StatePlan``), then built from its seed: the same plan
always gives the same bytes, so a child process rebuilds the parent's state dict. Tensor
contents are random bits with the top exponent bit cleared: finite, incompressible and
different in every chunk, so neither compression nor dedup can shortcut a full save.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

VOCAB = 32000
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class TensorSpec:
    path: Path_
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class StatePlan:
    case: str
    tensors: tuple[TensorSpec, ...]
    leaves: tuple[tuple[Path_, Any], ...]  # non-tensor leaves (ints, floats, lists ...)
    description: str
    seed: int

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


# -- planning (pure) ---------------------------------------------------------------------
def _linears(hidden: int, ffn: int) -> list[tuple[str, tuple[int, int]]]:
    h, f = hidden, ffn
    return [("q_proj", (h, h)), ("k_proj", (h, h)), ("v_proj", (h, h)), ("o_proj", (h, h)),
            ("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))]


def _ffn_for(hidden: int) -> int:
    return max(256, round(hidden * (11008 / 4096) / 256) * 256)


def _bf16_weight_bytes(hidden: int, layers: int) -> int:
    per_layer = 4 * hidden * hidden + 3 * hidden * _ffn_for(hidden) + 5 * hidden
    return 2 * (VOCAB * hidden + layers * per_layer + hidden)


def plan_llama(weight_bytes: int, max_bytes: int | None = None) -> tuple[int, int]:
    """(hidden, layers) of Llama-7B-shaped layers filling about ``weight_bytes`` of bf16;
    the width shrinks (multiples of 256) when one layer and the embedding exceed
    ``max_bytes`` (default ``weight_bytes``)."""
    limit = weight_bytes if max_bytes is None else max(weight_bytes, max_bytes)
    hidden = 4096
    while hidden > 256 and _bf16_weight_bytes(hidden, 1) > limit:
        hidden -= 256
    one = _bf16_weight_bytes(hidden, 1)
    per_layer = _bf16_weight_bytes(hidden, 2) - one
    return hidden, max(1, 1 + round((weight_bytes - one) / per_layer))


def _layer_name(i: int, name: str) -> str:
    return f"model.layers.{i}.{'self_attn' if name in ATTN else 'mlp'}.{name}"


def plan_llama_weights(hidden: int, layers: int) -> list[TensorSpec]:
    """Parameters in ``model.named_parameters()`` order (the optimizer's param ids)."""
    def spec(name: str, *shape: int) -> TensorSpec:
        return TensorSpec(("model", name), shape, torch.bfloat16)

    specs = [spec("model.embed_tokens.weight", VOCAB, hidden)]
    for i in range(layers):
        for name, shape in _linears(hidden, _ffn_for(hidden)):
            specs.append(spec(f"{_layer_name(i, name)}.weight", *shape))
            if name in ATTN[:3]:
                specs.append(spec(f"{_layer_name(i, name)}.bias", hidden))
        specs.append(spec(f"model.layers.{i}.input_layernorm.weight", hidden))
        specs.append(spec(f"model.layers.{i}.post_attention_layernorm.weight", hidden))
    return [*specs, spec("model.norm.weight", hidden)]


def plan_mixed(scale: float, *, total_bytes: int = 4 * 10**9) -> StatePlan:
    """~``total_bytes * scale``: 60 % bf16 weights, the rest fp32 Adam moments for the last
    parameters, nested like ``{"model": ..., "optimizer": optimizer.state_dict(), ...}``."""
    target = int(total_bytes * scale)
    hidden, layers = plan_llama(int(target * 0.6), int(target * 0.8))
    weights = plan_llama_weights(hidden, layers)
    budget = target - sum(w.nbytes for w in weights)
    with_state: list[int] = []
    for pid in range(len(weights) - 1, -1, -1):  # the last layers first, like a partial
        cost = 2 * weights[pid].numel * 4        # unfreeze; skip what no longer fits
        if cost <= budget:
            with_state.append(pid)
            budget -= cost
    specs = list(weights)
    for pid in sorted(with_state):
        shape, path = weights[pid].shape, ("optimizer", "state", pid)
        specs += [TensorSpec((*path, "step"), (), torch.float32),
                  TensorSpec((*path, "exp_avg"), shape, torch.float32),
                  TensorSpec((*path, "exp_avg_sq"), shape, torch.float32)]
    group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
             "amsgrad": False, "foreach": None, "params": list(range(len(weights)))}
    moments = sum(s.nbytes for s in specs[len(weights):])
    desc = (f"Llama-like bf16 weights, hidden {hidden}, ffn {_ffn_for(hidden)}, {layers} "
            f"layer(s) + {VOCAB}-token embedding ({sum(w.nbytes for w in weights) / 1e9:.2f} "
            f"GB); fp32 Adam exp_avg/exp_avg_sq for {len(with_state)} of {len(weights)} "
            f"params ({moments / 1e9:.2f} GB); `optimizer.state_dict()` nesting with int "
            "param ids, param_groups and `step` as non-tensor leaves")
    return StatePlan("mixed", tuple(specs), ((("optimizer", "param_groups"), [group]),
                                             (("step",), 100)), desc, seed=1)


def plan_lora(scale: float, *, base_bytes: int = 3 * 10**9,
              adapter_bytes: int = 50 * 10**6) -> StatePlan:
    """A frozen bf16 base plus fp32 ``lora_A``/``lora_B`` on every linear layer."""
    hidden, layers = plan_llama(int(base_bytes * scale))
    base = plan_llama_weights(hidden, layers)
    linears = _linears(hidden, _ffn_for(hidden))
    rank = max(1, round(adapter_bytes * scale / (4 * sum(a + b for _, (a, b) in linears)
                                                 * layers)))
    adapter = [TensorSpec(("model", f"{_layer_name(i, name)}.lora_{part}.weight"), shape,
                          torch.float32)
               for i in range(layers) for name, (out_f, in_f) in linears
               for part, shape in (("A", (rank, in_f)), ("B", (out_f, rank)))]
    desc = (f"frozen Llama-like bf16 base, hidden {hidden}, ffn {_ffn_for(hidden)}, "
            f"{layers} layer(s) ({sum(b.nbytes for b in base) / 1e9:.2f} GB) + fp32 "
            f"LoRA rank {rank} on all {len(adapter) // 2} linear layers "
            f"({sum(a.nbytes for a in adapter) / 1e6:.0f} MB); `step` as a non-tensor leaf")
    return StatePlan("lora", (*base, *adapter), ((("step",), 0),), desc, seed=2)


def adapter_paths(plan: StatePlan) -> list[Path_]:
    return [t.path for t in plan.tensors if "lora_" in str(t.path[-1])]


PLANS = {"mixed": plan_mixed, "lora": plan_lora}


# -- building ----------------------------------------------------------------------------
def _random_tensor(rng: np.random.Generator, spec: TensorSpec) -> torch.Tensor:
    if spec.numel == 0 or spec.nbytes % 8:
        return torch.full(spec.shape, 10.0 if spec.path[-1] == "step" else 0.5,
                          dtype=spec.dtype)
    words = rng.integers(0, np.iinfo(np.uint64).max, spec.nbytes // 8, dtype=np.uint64,
                         endpoint=True)
    uint, mask = {2: (np.uint16, 0xBFFF), 4: (np.uint32, 0xBFFFFFFF)}[spec.dtype.itemsize]
    bits = words.view(uint)
    np.bitwise_and(bits, uint(mask), out=bits)
    return torch.from_numpy(bits).view(spec.dtype).view(spec.shape)


def get_path(tree: Mapping[Any, Any], path: Path_) -> Any:
    node: Any = tree
    for key in path:
        node = node[key]
    return node


def build_state_dict(plan: StatePlan) -> dict[str, Any]:
    """The state dict the plan describes; the same plan always gives the same bytes."""
    rng = np.random.Generator(np.random.PCG64(plan.seed))
    sd: dict[str, Any] = {}
    for path, value in [*((s.path, _random_tensor(rng, s)) for s in plan.tensors),
                        *((path, copy.deepcopy(v)) for path, v in plan.leaves)]:
        node = sd
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return sd


# -- walking, mutating, checking ---------------------------------------------------------
def iter_leaves(tree: Mapping[Any, Any], prefix: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """(path, leaf) pairs, recursing into mappings only (lists and tuples are leaves)."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from iter_leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def tensors_of(tree: Mapping[Any, Any]) -> list[torch.Tensor]:
    return [v for _, v in iter_leaves(tree) if isinstance(v, torch.Tensor)]


def state_bytes(tree: Mapping[Any, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(tree))


def flip_bits(tensors: list[torch.Tensor], mask: int) -> None:
    """XOR ``mask`` (a low mantissa bit: 1, 2, 4 ...) into every element, in place: new
    data, cheaply; the same mask twice restores the original bits."""
    for t in tensors:
        if t.numel() and t.dim():
            t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
                   ).bitwise_xor_(mask)


def empty_like_tree(tree: Mapping[Any, Any]) -> dict[Any, Any]:
    """Same nesting, tensors replaced by zeroed (touched) tensors: a preallocated target."""
    return {key: empty_like_tree(value) if isinstance(value, Mapping)
            else torch.zeros_like(value) if isinstance(value, torch.Tensor) else value
            for key, value in tree.items()}


def touch_pages(tree: Mapping[Any, Any]) -> None:
    """Read one byte of every 4 KiB of every tensor, so lazily mapped restores (mmap)
    pay for their reads inside the timing."""
    for t in tensors_of(tree):
        if t.numel() * t.element_size() >= 4096:
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def _plain(value: Any) -> Any:
    """A non-tensor leaf as stores may give it back: tuples as lists, keys as text."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def check_equal(original: Mapping[Any, Any], restored: Mapping[Any, Any]) -> None:
    """Raise AssertionError naming the first differences: every tensor bit-equal (dtype,
    shape, values), every other leaf equal up to tuple -> list and int -> str keys."""
    want, got = ({"/".join(map(str, path)): leaf for path, leaf in iter_leaves(tree)}
                 for tree in (original, restored))
    problems = [f"missing {k}" for k in want.keys() - got.keys()]
    problems += [f"unexpected {k}" for k in got.keys() - want.keys()]
    for key in want.keys() & got.keys():
        a, b = want[key], got[key]
        if isinstance(a, torch.Tensor):
            same = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a, b))
        else:
            same = _plain(a) == _plain(b)
        if not same:
            problems.append(f"{key} differs")
    if problems:
        raise AssertionError("restored state differs: " + "; ".join(problems[:3]))
