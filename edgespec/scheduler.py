"""Where the drafter's work runs: after the target's (`Sequential`) or beside it (`Overlapped`).

The engine asks its scheduler at three points of a request: start the drafter's prefill (`start_prefill`, while
the target takes in the prompt), draft the next round while the target verifies this one (`draft_ahead`), and
wait for that work before the round ends (`collect`). Sequential speculation does nothing at any of them: the
drafter drafts when the engine asks it to propose.

`Overlapped`: while the target verifies round i, the drafter (on its own thread) already drafts round i+1 as if
all of round i were accepted and the target's next token were the drafter's own guess. When verification agrees
the next draft is ready; otherwise it is thrown away and drafted again from the corrected prefix. When sampling,
the drafter's guess is judged by the rule as one more draft at the bonus position (kept as often as a draft is
accepted; an independent bonus draw matched it in about 63% of SmolLM2's T = 0.7 rounds against the ~88% the
cost model assumes). The drafter's work always runs to completion before the round ends, so the random draws
do not depend on timing, and the output is the same as sequential speculation's in distribution (greedy: token
for token). Only a drafter that `can_draft_ahead` (a draft model) is overlapped.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .drafters.guard import GuardedDrafter
from .sampling import SamplingParams

THREAD_PREFIX = "edgespec-draft"


@dataclass
class Ahead:
    """The drafting done ahead during a round: seconds of drafting (its catch-up on unseen context left out),
    tokens drafted (None: it failed), and how long the engine's thread then waited for it."""

    seconds: float
    tokens: int | None
    wait_s: float


class Sequential:
    """Draft, then verify, one after the other on the engine's thread: nothing to schedule."""

    def start_prefill(self, drafts: GuardedDrafter) -> None:
        pass  # the draft model takes in the prompt at its first drafted round (K = 0 never pays it)

    def finish_prefill(self) -> None:
        pass

    def draft_ahead(self, drafts: GuardedDrafter, n_drafted: int, params: SamplingParams,
                    rng: torch.Generator, p_min: float) -> None:
        pass

    def collect(self) -> Ahead | None:
        return None

    def close(self) -> None:
        pass


class Overlapped:
    """The drafter's prefill and its drafting ahead run on one thread of their own (see the module's text)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_PREFIX)
        self._prefill: Future | None = None
        self._ahead: Future | None = None

    def start_prefill(self, drafts: GuardedDrafter) -> None:
        """The draft model takes in the prompt on its own thread while the target does."""
        self._prefill = self._pool.submit(drafts.prefill)

    def finish_prefill(self) -> None:
        if self._prefill is not None:
            self._prefill.result()  # (the guard turns a failure into its notice)
            self._prefill = None

    def draft_ahead(self, drafts: GuardedDrafter, n_drafted: int, params: SamplingParams,
                    rng: torch.Generator, p_min: float) -> None:
        """Draft the next round while the target verifies: its first token is the guess at the target's next
        token, then K more."""
        if n_drafted > 0 and drafts.active:
            self._ahead = self._pool.submit(self._timed, drafts, 2 * n_drafted + 1, params, rng, p_min)

    def _timed(self, drafts: GuardedDrafter, total: int, params: SamplingParams, rng: torch.Generator,
               p_min: float) -> tuple[float, int | None]:
        start = self.clock()
        out = drafts.propose_ahead(total, params, rng, p_min)
        seconds = self.clock() - start
        if out is None:
            return seconds, None
        n, catch_up_s = out
        return max(seconds - catch_up_s, 0.0), int(n)

    def collect(self) -> Ahead | None:
        """Wait for this round's drafting ahead (None when there was none)."""
        if self._ahead is None:
            return None
        t_wait = self.clock()
        seconds, tokens = self._ahead.result()
        self._ahead = None
        return Ahead(seconds, tokens, self.clock() - t_wait)

    def close(self) -> None:
        """Also on cancel or a failure: no drafter thread outlives the request (it finishes its work first)."""
        self._pool.shutdown(wait=True)
