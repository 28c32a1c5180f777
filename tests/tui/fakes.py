"""Fakes and helpers for the TUI tests: a session whose token stream is gated by the test, and wait_until.

A plain module, not conftest.py: tests/conftest.py exists too, and `from conftest import` would be ambiguous.
"""

from __future__ import annotations

import threading
import time

from edgespec.errors import EdgespecError
from edgespec.metrics import SpecMetrics
from edgespec.session import DRAFT, TARGET, Chunk

# Seconds a test waits for something that should happen at once before it calls it hung. Only a broken test ever
# waits this long, so it is generous: four test runs on two cores can stall a thread for seconds.
CAP = 120.0


class GatedSession:
    """Duck-types `ChatSession`. Each turn replays `script` (a list of chunks, each a list of (text, origin)),
    waiting before every chunk until the test calls `release()`; with `gated=False` it never waits.
    Like the real session it honours `cancel` after the current round, ending with a "cancelled" chunk.
    `fail_after=n` raises EdgespecError after n chunks (once)."""

    target_description = "fake-target"
    draft_description = "fake-draft"

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
                raise RuntimeError("GatedSession: the test never released the next chunk")
        return True

    def reply(self, messages, settings, *, system=None, cancel=None):
        self.calls.append({"messages": [dict(m) for m in messages], "settings": settings, "system": system})
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


def fixed_factory(session):
    def factory(progress):
        progress("fake: loading")
        return session
    return factory


async def wait_until(pilot, predicate, timeout: float = CAP, what: str = "condition") -> None:
    """Let the app run until `predicate()` holds; fail after `timeout` seconds (a cap for a hung test, never
    a wait: it returns as soon as the predicate holds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.01)
