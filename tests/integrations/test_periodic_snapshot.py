"""PeriodicSnapshot and the RNG states it stores, without a training loop."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from isolane import SnapshotStore
from isolane.errors import InvalidArgumentError, UnsupportedValueError
from isolane.integrations.callbacks import PeriodicSnapshot, snapshots_with_prefix
from isolane.integrations.rng import capture_rng, restore_rng


def draws() -> tuple[list[float], list[float], list[float], float]:
    return (torch.rand(4).tolist(), [random.random() for _ in range(4)],
            np.random.rand(4).tolist(), random.gauss(0, 1))


def test_rng_states_round_trip_through_a_snapshot(tmp_path: Path) -> None:
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.standard_normal()  # and one in NumPy's
    state = capture_rng()
    expected = draws()
    with SnapshotStore(tmp_path) as store:
        store.save({"rng": state}, "rng")
        loaded = store.load("rng")["rng"]
    draws()  # move every generator on
    restore_rng(loaded)
    assert draws() == expected


def test_restore_rng_refuses_foreign_values() -> None:
    with pytest.raises(InvalidArgumentError, match="capture_rng"):
        restore_rng({"torch": torch.get_rng_state()})


def small() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
               sched: torch.optim.lr_scheduler.StepLR) -> None:
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


@pytest.mark.parametrize("async_", [True, False])
def test_saves_on_cadence_and_keeps_only_its_own_prefix(tmp_path: Path, async_: bool) -> None:
    model, opt, sched = small()
    with SnapshotStore(tmp_path) as store:
        store.save({"w": torch.zeros(2)}, "other-1")  # not ours: retention leaves it alone
        with PeriodicSnapshot(store, every_n_steps=2, keep_last=2, async_=async_) as ckpt:
            started = []
            for step in range(1, 8):
                train_step(model, opt, sched)
                started.append(ckpt.step(step, model, opt, sched, extra={"epoch": step // 3}))
        assert started == [False, True, False, True, False, True, False]
        assert snapshots_with_prefix(store, "step-") == [(4, "step-4"), (6, "step-6")]
        assert "other-1" in [i.name for i in store.list()]
        saved = store.load("step-6")
        assert saved["step"] == 6 and saved["extra"] == {"epoch": 2}
        assert saved["scheduler"]["last_epoch"] == 6
        assert set(saved["optimizer"]["state"]) == {0, 1, 2, 3}  # int keys kept


def test_resume_restores_model_optimizer_scheduler_and_extra(tmp_path: Path) -> None:
    model, opt, sched = small()
    with SnapshotStore(tmp_path) as store:
        ckpt = PeriodicSnapshot(store, every_n_steps=3, keep_last=None)
        for step in range(1, 4):
            train_step(model, opt, sched)
            ckpt.step(step, model, opt, sched, extra={"seen": [1, 2]})
        ckpt.close()
        m2, o2, s2 = small()
        fresh = PeriodicSnapshot(store, every_n_steps=3)
        assert fresh.resume(m2, o2, s2) == 3
        assert fresh.extra == {"seen": [1, 2]}
        for a, b in zip(model.state_dict().values(), m2.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        assert s2.get_last_lr() == sched.get_last_lr()
        assert torch.equal(o2.state_dict()["state"][0]["exp_avg"],
                           opt.state_dict()["state"][0]["exp_avg"])
        assert PeriodicSnapshot(store, 3, prefix="other-").resume(*small()[:2]) == 0


def test_unstorable_extra_is_refused_with_its_key(tmp_path: Path) -> None:
    model, opt, _ = small()
    with SnapshotStore(tmp_path) as store, PeriodicSnapshot(store, 1) as ckpt:
        with pytest.raises(UnsupportedValueError, match=r"\['extra'\]\['fn'\]"):
            ckpt.save(1, model, opt, extra={"fn": print})
        assert store.list() == []


@pytest.mark.parametrize("prefix", ["", "step-1", "a/b", "-x"])
def test_bad_prefixes_are_refused(tmp_path: Path, prefix: str) -> None:
    with SnapshotStore(tmp_path) as store, pytest.raises(InvalidArgumentError):
        PeriodicSnapshot(store, 1, prefix=prefix)
