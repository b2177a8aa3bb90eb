"""Synthetic training state dicts for the checkpoint benchmarks, and how to check them.

A state dict is first planned as data (``StatePlan``: the tensors' paths, shapes and
dtypes plus the non-tensor leaves), then built from a seed, so a child process rebuilds
exactly the parent's state dict from ``(case, scale)``.

Tensor contents are random bits with the top exponent bit cleared: finite values in
(-2, 2), incompressible, and different in every chunk, so neither compression nor
content dedup can shortcut a "full" save. ``flip_bits`` changes every element of every
tensor exactly and reversibly (an XOR of one mantissa bit) to make "new data" cheaply.
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
FFN_PER_HIDDEN = 11008 / 4096
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
@dataclass(frozen=True)
class LlamaDims:
    hidden: int
    ffn: int
    layers: int

    def linear_shapes(self) -> list[tuple[str, tuple[int, int]]]:
        h, f = self.hidden, self.ffn
        shapes = {"q_proj": (h, h), "k_proj": (h, h), "v_proj": (h, h), "o_proj": (h, h),
                  "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
        return list(shapes.items())


def _bf16_weight_bytes(hidden: int, layers: int) -> int:
    ffn = _ffn_for(hidden)
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn + 5 * hidden
    return 2 * (VOCAB * hidden + layers * per_layer + hidden)


def _ffn_for(hidden: int) -> int:
    return max(256, round(hidden * FFN_PER_HIDDEN / 256) * 256)


def plan_llama_dims(weight_bytes: int, max_bytes: int | None = None) -> LlamaDims:
    """Llama-7B-shaped layers (4096 x 4096, 4096 x 11008) filling about ``weight_bytes`` of
    bf16; the width shrinks (multiples of 256) when even one layer and the embedding
    exceed ``max_bytes`` (default ``weight_bytes``)."""
    limit = weight_bytes if max_bytes is None else max(weight_bytes, max_bytes)
    hidden = 4096
    while hidden > 256 and _bf16_weight_bytes(hidden, 1) > limit:
        hidden -= 256
    one = _bf16_weight_bytes(hidden, 1)
    per_layer = _bf16_weight_bytes(hidden, 2) - one
    layers = max(1, 1 + round((weight_bytes - one) / per_layer))
    return LlamaDims(hidden, _ffn_for(hidden), layers)


def plan_llama_weights(dims: LlamaDims) -> list[TensorSpec]:
    """Parameters in ``model.named_parameters()`` order (the optimizer's param ids)."""
    bf16, h = torch.bfloat16, dims.hidden
    specs = [TensorSpec(("model", "model.embed_tokens.weight"), (VOCAB, h), bf16)]
    for i in range(dims.layers):
        pre = f"model.layers.{i}"
        for name, shape in dims.linear_shapes():
            part = "self_attn" if name in ATTN else "mlp"
            specs.append(TensorSpec(("model", f"{pre}.{part}.{name}.weight"), shape, bf16))
            if name in ("q_proj", "k_proj", "v_proj"):
                specs.append(TensorSpec(("model", f"{pre}.{part}.{name}.bias"), (h,), bf16))
        specs.append(TensorSpec(("model", f"{pre}.input_layernorm.weight"), (h,), bf16))
        specs.append(TensorSpec(("model", f"{pre}.post_attention_layernorm.weight"), (h,),
                                bf16))
    specs.append(TensorSpec(("model", "model.norm.weight"), (h,), bf16))
    return specs


def plan_mixed(scale: float, *, total_bytes: int = 4 * 10**9) -> StatePlan:
    """~``total_bytes * scale``: 60 % bf16 weights, the rest fp32 Adam moments for the last
    parameters, nested like ``{"model": ..., "optimizer": optimizer.state_dict(), ...}``."""
    target = int(total_bytes * scale)
    dims = plan_llama_dims(int(target * 0.6), int(target * 0.8))
    weights = plan_llama_weights(dims)
    budget = target - sum(w.nbytes for w in weights)
    with_state: list[int] = []
    for pid in range(len(weights) - 1, -1, -1):  # the last layers first, like a partial
        cost = 2 * weights[pid].numel * 4        # unfreeze; skip what no longer fits
        if cost <= budget:
            with_state.append(pid)
            budget -= cost
    with_state.sort()
    specs = list(weights)
    for pid in with_state:
        shape = weights[pid].shape
        specs.append(TensorSpec(("optimizer", "state", pid, "step"), (), torch.float32))
        specs.append(TensorSpec(("optimizer", "state", pid, "exp_avg"), shape, torch.float32))
        specs.append(TensorSpec(("optimizer", "state", pid, "exp_avg_sq"), shape,
                                torch.float32))
    group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
             "amsgrad": False, "foreach": None, "params": list(range(len(weights)))}
    leaves: tuple[tuple[Path_, Any], ...] = (
        (("optimizer", "param_groups"), [group]), (("step",), 100))
    moments = sum(s.nbytes for s in specs[len(weights):])
    desc = (f"Llama-like bf16 weights, hidden {dims.hidden}, ffn {dims.ffn}, {dims.layers} "
            f"layer(s) + {VOCAB}-token embedding ({sum(w.nbytes for w in weights) / 1e9:.2f} "
            f"GB); fp32 Adam exp_avg/exp_avg_sq for {len(with_state)} of {len(weights)} "
            f"params ({moments / 1e9:.2f} GB); `optimizer.state_dict()` nesting with int "
            "param ids, param_groups and `step` as non-tensor leaves")
    return StatePlan("mixed", tuple(specs), leaves, desc, seed=1)


def plan_lora(scale: float, *, base_bytes: int = 3 * 10**9,
              adapter_bytes: int = 50 * 10**6) -> StatePlan:
    """A frozen bf16 base plus fp32 ``lora_A``/``lora_B`` on every linear layer."""
    dims = plan_llama_dims(int(base_bytes * scale))
    base = plan_llama_weights(dims)
    per_rank = 4 * sum(a + b for _, (a, b) in dims.linear_shapes()) * dims.layers
    rank = max(1, round(adapter_bytes * scale / per_rank))
    adapter = []
    for i in range(dims.layers):
        for name, (out_f, in_f) in dims.linear_shapes():
            part = "self_attn" if name in ATTN else "mlp"
            pre = f"model.layers.{i}.{part}.{name}"
            adapter.append(TensorSpec(("model", f"{pre}.lora_A.weight"), (rank, in_f),
                                      torch.float32))
            adapter.append(TensorSpec(("model", f"{pre}.lora_B.weight"), (out_f, rank),
                                      torch.float32))
    desc = (f"frozen Llama-like bf16 base, hidden {dims.hidden}, ffn {dims.ffn}, "
            f"{dims.layers} layer(s) ({sum(b.nbytes for b in base) / 1e9:.2f} GB) + fp32 "
            f"LoRA rank {rank} on all {len(adapter) // 2} linear layers "
            f"({sum(a.nbytes for a in adapter) / 1e6:.0f} MB); `step` as a non-tensor leaf")
    return StatePlan("lora", (*base, *adapter), ((("step",), 0),), desc, seed=2)


def adapter_paths(plan: StatePlan) -> list[Path_]:
    return [t.path for t in plan.tensors if "lora_" in str(t.path[-1])]


PLANS = {"mixed": plan_mixed, "lora": plan_lora}


# -- building ----------------------------------------------------------------------------
_MASK = {2: np.uint16(0xBFFF), 4: np.uint32(0xBFFFFFFF)}
_UINT = {2: np.uint16, 4: np.uint32}


def _random_tensor(rng: np.random.Generator, spec: TensorSpec) -> torch.Tensor:
    if spec.numel == 0 or spec.nbytes % 8:
        return torch.full(spec.shape, 10.0 if spec.path[-1] == "step" else 0.5,
                          dtype=spec.dtype)
    words = rng.integers(0, np.iinfo(np.uint64).max, spec.nbytes // 8, dtype=np.uint64,
                         endpoint=True)
    bits = words.view(_UINT[spec.dtype.itemsize])
    np.bitwise_and(bits, _MASK[spec.dtype.itemsize], out=bits)
    return torch.from_numpy(bits).view(spec.dtype).view(spec.shape)


def set_path(tree: dict[Any, Any], path: Path_, value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def get_path(tree: Mapping[Any, Any], path: Path_) -> Any:
    node: Any = tree
    for key in path:
        node = node[key]
    return node


def build_state_dict(plan: StatePlan) -> dict[str, Any]:
    """The state dict the plan describes; the same plan always gives the same bytes."""
    rng = np.random.Generator(np.random.PCG64(plan.seed))
    sd: dict[str, Any] = {}
    for spec in plan.tensors:
        set_path(sd, spec.path, _random_tensor(rng, spec))
    for path, value in plan.leaves:
        set_path(sd, path, copy.deepcopy(value))
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


_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bits(tensors: list[torch.Tensor], mask: int) -> None:
    """XOR ``mask`` (a low mantissa bit: 1, 2, 4 ...) into every element, in place.

    Applying the same mask twice restores the original bits exactly.
    """
    for t in tensors:
        if t.numel() and t.dim():
            t.view(_INT_VIEW[t.element_size()]).bitwise_xor_(mask)


def empty_like_tree(tree: Mapping[Any, Any]) -> dict[Any, Any]:
    """Same nesting, tensors replaced by zeroed (touched) tensors: a preallocated target."""
    return {key: empty_like_tree(value) if isinstance(value, Mapping)
            else torch.zeros_like(value) if isinstance(value, torch.Tensor) else value
            for key, value in tree.items()}


def touch_pages(tree: Mapping[Any, Any]) -> None:
    """Read one byte of every 4 KiB of every tensor, so lazily mapped restores (mmap)
    pay for their reads inside the timing; nearly free for tensors already in memory."""
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


def differences(original: Mapping[Any, Any], restored: Mapping[Any, Any]) -> list[str]:
    """What differs between two state dicts: every tensor bit-equal (dtype, shape,
    values), every other leaf equal up to tuple -> list and int -> str keys."""
    def flat(tree: Mapping[Any, Any]) -> dict[str, Any]:
        return {"/".join(map(str, path)): leaf for path, leaf in iter_leaves(tree)}

    want, got = flat(original), flat(restored)
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
    return problems


def check_equal(original: Mapping[Any, Any], restored: Mapping[Any, Any]) -> None:
    """Raise AssertionError naming the first differences, if any."""
    problems = differences(original, restored)
    if problems:
        raise AssertionError("restored state differs: " + "; ".join(problems[:3]))
