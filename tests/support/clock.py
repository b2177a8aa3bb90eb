"""A clock for tests: time moves only when a test moves it, so control laws and windows
can be stepped exactly (injected where the code takes ``clock=``)."""

from __future__ import annotations


class FakeClock:
    """Time that moves only when told; ``sleep`` advances it (and is recorded)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
