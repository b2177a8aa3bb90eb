"""The plans a node keeps between a plan request and its upload (pure: a fake clock)."""

from __future__ import annotations

import pytest

from isolane.errors import InvalidArgumentError
from isolane.node.upload_plans import UploadPlans, check_plan_token, owner_of


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _plans(**kwargs: object) -> tuple[UploadPlans[str], Clock]:
    clock = Clock()
    return UploadPlans(clock=clock, **kwargs), clock  # type: ignore[arg-type]


def test_a_kept_plan_is_taken_once_by_its_owner_alone() -> None:
    plans, _ = _plans()
    token = plans.keep("alice", "plan-a")
    assert plans.take(token, "mallory") is None  # foreign: not handed out ...
    assert plans.take(token, "alice") == "plan-a"  # ... and not spent by the stranger
    assert plans.take(token, "alice") is None  # used once
    assert plans.take("no-such-token-at-all", "alice") is None
    assert plans.take(None, "alice") is None


def test_plans_expire_and_the_oldest_go_first_past_the_cap() -> None:
    plans, clock = _plans(max_entries=3, max_age_s=60.0)
    old = plans.keep("o", "old")
    clock.now += 61
    assert plans.take(old, "o") is None  # stale
    tokens = [plans.keep("o", f"p{i}") for i in range(5)]
    assert len(plans) == 3
    assert plans.take(tokens[0], "o") is None and plans.take(tokens[1], "o") is None
    assert [plans.take(t, "o") for t in tokens[2:]] == ["p2", "p3", "p4"]
    assert len(plans) == 0


def test_tokens_are_unguessable_and_distinct() -> None:
    plans, _ = _plans()
    tokens = {plans.keep("o", "x") for _ in range(200)}
    assert len(tokens) == 200
    assert all(check_plan_token(t) == t and len(t) >= 22 for t in tokens)


@pytest.mark.parametrize("bad", ["", "short", "a" * 200, "abc/def-ghijklmnopqrstuv",
                                 "abcdefghijklmnopqrstuvwxyz\n"])
def test_a_malformed_plan_token_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgumentError, match="X-Isolane-Plan"):
        check_plan_token(bad)


def test_the_owner_binds_credentials_client_peer_name_and_overwrite() -> None:
    base = owner_of("Bearer t", "c1", "127.0.0.1", "snap", overwrite=False)
    assert base == owner_of("Bearer t", "c1", "127.0.0.1", "snap", overwrite=False)
    others = {owner_of("Bearer u", "c1", "127.0.0.1", "snap", overwrite=False),
              owner_of("Bearer t", "c2", "127.0.0.1", "snap", overwrite=False),
              owner_of("Bearer t", "c1", "127.0.0.2", "snap", overwrite=False),
              owner_of("Bearer t", "c1", "127.0.0.1", "snap2", overwrite=False),
              owner_of("Bearer t", "c1", "127.0.0.1", "snap", overwrite=True),
              owner_of(None, "c1", "127.0.0.1", "snap", overwrite=False)}
    assert base not in others and len(others) == 6
    assert "Bearer" not in base  # the credentials only as a digest
