"""Fakes and helpers for the TUI tests: a model whose token stream is gated by the test, and wait_until.

A plain module, not conftest.py: tests/conftest.py exists too, and `from conftest import` would be ambiguous.
"""

from __future__ import annotations

import threading
import time

from edgespec.api import DRAFT, TARGET, Chunk, Model
from edgespec.errors import EdgespecError
from edgespec.metrics import SpecMetrics

# Seconds a test waits for something that should happen at once before it calls it hung. Only a broken test ever
# waits this long, so it is generous: four test runs on two cores can stall a thread for seconds.
CAP = 120.0


class GatedModel:
    """Duck-types what the app uses of `edgespec.api.Model`: `chat(messages, system=, stream=True, cancel=,
    **settings)` and `description`. The settings go through the real `Model.request` (so the app must send what
    the API takes, and a bad value is the API's RequestError); `calls` records each turn's validated `Settings`.
    Each turn replays `script` (a list of chunks, each a list of (text, origin)), waiting before every chunk until
    the test calls `release()`; with `gated=False` it never waits. Like the real model it honours `cancel` after
    the current round, ending with a "cancelled" chunk. `fail_after=n` raises EdgespecError after n chunks (once)."""

    description = {"target": "fake-target", "draft": "fake-draft"}
    temperature = 0.0  # the defaults `Model.request` fills in (as `load`'s)
    k = "auto"

    def __init__(self, script=None, *, gated: bool = True, fail_after: int | None = None):
        self.script = script or [[("Hello", DRAFT), (" there", TARGET)], [(", world", DRAFT)], [("!", TARGET)]]
        self.gated = gated
        self.fail_after = fail_after
        self.calls: list[dict] = []
        self._gate = threading.Semaphore(0)

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate.release()

    def _wait(self, cancel) -> bool:
        """True when the next chunk may go; False when cancelled while waiting."""
        if not self.gated:
            return True
        deadline = time.monotonic() + CAP
        while not self._gate.acquire(timeout=0.005):
            if cancel is not None and cancel.is_set():
                return False
            if time.monotonic() > deadline:
                raise RuntimeError("GatedModel: the test never released the next chunk")
        return True

    def chat(self, messages, *, system=None, stream=False, cancel=None, **settings):
        assert stream, "the app streams its answers"
        settings = Model.request(self, **settings).settings  # the API's own validation
        self.calls.append({"messages": [dict(m) for m in messages], "settings": settings, "system": system})
        return self._answer(settings, cancel)

    def _answer(self, settings, cancel):
        metrics = SpecMetrics()
        metrics.wall_s = 1.0 if settings.speculation else 2.0  # "speculation doubles the speed"
        for i, pieces in enumerate(self.script):
            if self.fail_after is not None and i == self.fail_after:
                self.fail_after = None
                raise EdgespecError("the fake model fell over; try again")
            if not self._wait(cancel):
                yield Chunk([], 4, metrics, "cancelled")
                return
            metrics.num_emitted_tokens += len(pieces)
            reason = "eos" if i == len(self.script) - 1 else None
            if reason is None and cancel is not None and cancel.is_set():
                reason = "cancelled"
            yield Chunk(list(pieces), 4 if settings.speculation else 0, metrics, reason)
            if reason:
                return


def fixed_factory(model):
    def factory(progress):
        progress("fake: loading")
        return model
    return factory


async def wait_until(pilot, predicate, timeout: float = CAP, what: str = "condition") -> None:
    """Let the app run until `predicate()` holds; fail after `timeout` seconds (a cap for a hung test, never
    a wait: it returns as soon as the predicate holds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.01)
