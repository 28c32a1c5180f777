"""`GuardedDrafter`: a drafter's failure ends speculation for the request, never the request.

Speculation is an optimisation: whatever a drafter does wrong (an ONNX session lost, a cache out of step, a bug
in a new drafter), the target alone can finish the answer, token for token what it would have been. The guard
wraps every call of the `Drafter` protocol: the first exception turns the drafter off until the next request
(it proposes nothing, hears nothing) and leaves one notice for the engine to hand to the user.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .base import Draft, Drafter


class GuardedDrafter:
    def __init__(self, drafter: Drafter):
        self.inner = drafter
        self.failed = False
        self._notice: str | None = None

    @property
    def active(self) -> bool:
        return not self.failed

    @property
    def free(self) -> bool:
        return self.inner.free

    @property
    def can_draft_ahead(self) -> bool:
        return self.inner.can_draft_ahead

    @property
    def lag(self) -> int:
        return self._call(lambda: self.inner.lag, 0)

    def take_notice(self) -> str | None:
        """The failure notice, once (None when nothing failed since the last call)."""
        notice, self._notice = self._notice, None
        return notice

    def begin(self, prompt_ids: list[int], stop_ids: frozenset[int]) -> None:
        """A new request: the drafter gets a fresh chance (a failure lasts one request)."""
        self.failed, self._notice = False, None

        def start():
            self.inner.stop_ids = stop_ids
            self.inner.begin(prompt_ids)

        self._call(start, None)

    def prefill(self) -> None:
        self._call(self.inner.prefill, None)

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator, p_min: float) -> Draft:
        return self._call(lambda: self.inner.propose(k, params, generator, p_min=p_min), Draft([]))

    def propose_ahead(self, total: int, params: SamplingParams, generator: torch.Generator,
                      p_min: float) -> tuple[int, float] | None:
        """None when the drafter failed (or had already)."""
        return self._call(lambda: self.inner.propose_ahead(total, params, generator, p_min=p_min), None)

    def peek(self, i: int) -> tuple[int, torch.Tensor | None] | None:
        return self._call(lambda: self.inner.peek(i), None)

    def commit(self, n_accepted: int, next_token: int) -> None:
        self._call(lambda: self.inner.commit(n_accepted, next_token), None)

    def _call(self, fn, default):
        if self.failed:
            return default
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - any drafter failure: the target alone finishes the answer
            self.failed = True
            self._notice = f"the drafter failed ({type(err).__name__}: {err}); this answer continues on the target alone"
            return default
