"""K policies: how many tokens to draft in the next round.

A policy sees each finished round (`observe`) and answers `next_k()`. It does not draft, verify or time
anything itself. K = 0 means plain decoding for that round, through the same loop.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Protocol, runtime_checkable

from .errors import EdgespecError

MAX_K = 16
# --k auto stops a model draft after a token the draft model gave less than this probability (llama.cpp's
# --draft-p-min); fixed K drafts K. 0 = never stop early.
DEFAULT_P_MIN = 0.0


def check_p_min(p_min) -> float:
    """A user-given p_min, validated: a probability from 0 (never stop a draft early) to 1."""
    if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0.0 <= p_min <= 1.0:
        raise EdgespecError(f"p_min={p_min!r} is out of range; use a probability from 0 (never stop a draft early) to 1")
    return float(p_min)


def parse_p_min(text: str | float | None, *, many: bool = False) -> float | list[float] | None:
    """--p-min from the command line: None when not given; a probability, or with `many` a comma list of them
    (bench). A clear one-line error otherwise."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else check_p_min(text)
    parts = str(text).split(",")
    if len(parts) > 1 and not many:
        raise EdgespecError(f"--p-min {text}: give one probability here (a comma list is for bench)")
    try:
        values = [check_p_min(float(part)) for part in parts]
    except ValueError:
        raise EdgespecError(f"--p-min {text}: not a probability; give a number from 0 (off) to 1") from None
    except EdgespecError:
        raise EdgespecError(f"--p-min {text}: out of range; give a probability from 0 (off) to 1") from None
    return values if many else values[0]


def check_k(k: int) -> int:
    """A user-given K, validated: 0 (speculation off) up to MAX_K."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K:
        raise EdgespecError(f"K={k!r} is out of range; use an integer from 0 (no speculation) to {MAX_K}")
    return k


@runtime_checkable
class KPolicy(Protocol):
    """What the engine asks of a K policy (all of it: see `PolicyBase` for the defaults)."""

    k_max: int  # the most K it asks for (a free drafter's shadow proposals are this long)
    p_min: float  # > 0: a model draft stops after a token its model gave less than this
    learns_from_shadow: bool  # while K = 0, hear how a free drafter's proposals would have fared

    def begin_request(self, *, min_rows: int = 1) -> None:
        """A new request (one answer) starts; the engine calls it before the first round. `min_rows`: the rows
        a short target step runs as (more than 1 for an exact target, whose short steps are padded)."""

    def next_k(self, *, remaining: int | None = None, lag: int = 0) -> int:
        """K for the next round. `remaining`: tokens the request may still emit; `lag`: tokens the drafter
        must feed before it can draft (its lazy prefill), a one-off cost on top of drafting K."""

    def observe(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float, *,
                catch_up_s: float = 0.0, catch_up_tokens: int = 0, drafted: int | None = None) -> None:
        """A finished round: `draft_s` excludes the catch-up (`catch_up_s` for `catch_up_tokens` tokens) and is
        the drafter's work on `drafted` tokens (None: the `n_drafted` proposed; overlapped, the tokens it drafted
        this round wherever it ran, some of them for the next round); `verify_s` is the target's own time."""

    def observe_shadow(self, n_proposed: int, n_matched: int) -> None:
        """With `learns_from_shadow`: a free drafter proposed `n_proposed` tokens while K was 0 and the first
        `n_matched` of them are what the target went on to emit."""


class PolicyBase:
    """`KPolicy`'s defaults: learns nothing, drafts to the end (p_min 0), ignores shadow proposals."""

    k_max = MAX_K
    p_min = 0.0
    learns_from_shadow = False

    def begin_request(self, *, min_rows: int = 1) -> None:
        pass

    def observe(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float, *,
                catch_up_s: float = 0.0, catch_up_tokens: int = 0, drafted: int | None = None) -> None:
        pass

    def observe_shadow(self, n_proposed: int, n_matched: int) -> None:
        pass


class ShadowProbe:
    """A free drafter (an n-gram lookup: microseconds, nothing to roll back) is still asked while the policy
    has speculation off: its proposal is checked against the tokens the target goes on to emit, and the policy
    learns from that what drafting would have gained, so it can switch speculation back on. Matching the
    target's own token is accepting: for a one-hot draft P(match) = p_target(draft) = P(accept)."""

    def __init__(self, policy: KPolicy):
        self.policy = policy
        self.tokens: list[int] | None = None  # the proposal being checked
        self.hits = 0

    def wants_proposal(self, k: int) -> bool:
        """Should the drafter be asked for `policy.k_max` tokens to check before this round (K = `k`)?"""
        if k > 0:
            self.tokens = None  # speculation is back on: its rounds say the rest
        return k == 0 and self.tokens is None

    def start(self, tokens: list[int]) -> None:
        if tokens:
            self.tokens, self.hits = list(tokens), 0
        else:
            self.policy.observe_shadow(0, 0)

    def see(self, emitted: list[int]) -> None:
        """The tokens a round emitted (two with an accepted guess): report the proposal once it is decided."""
        if self.tokens is None:
            return
        for token in emitted:
            hit = token == self.tokens[self.hits]
            self.hits += hit
            if not hit or self.hits == len(self.tokens):
                self.policy.observe_shadow(len(self.tokens), self.hits)
                self.tokens = None
                return


class FixedK(PolicyBase):
    """The same K every round."""

    def __init__(self, k: int, *, p_min: float = 0.0):
        self.k = check_k(k)
        self.k_max = self.k
        self.p_min = check_p_min(p_min)  # > 0: a model draft stops after a token its model is less sure of

    def next_k(self, *, remaining: int | None = None, lag: int = 0) -> int:
        return self.k

    def __repr__(self) -> str:
        return f"FixedK({self.k})" if not self.p_min else f"FixedK({self.k}, p_min={self.p_min})"


class AdaptiveK(PolicyBase):
    """K re-solved every round by the cost model from acceptance and latencies estimated while generating.

    Acceptance: per-position conditional rates (P(draft i proposed and accepted | K asked for it and the drafts
    before it accepted)), from exponentially decayed counts smoothed toward a prior, so a change in the text
    moves K within a few rounds. A drafter may propose fewer than K (an n-gram lookup without a long match):
    `reach` (P(the proposal reaches position i)) then discounts the cost of positions it seldom proposes.
    Latencies: the profile's table when there is one, rescaled by what recent rounds measure (the median of
    the last `window` rounds, robust to one preempted round); without a profile, the first rounds calibrate by trying a few
    K values. When no K is predicted to beat plain decoding, K = 0, with a probe round every `probe_every`
    rounds (the interval doubles while probes keep losing) so speculation comes back when the text turns
    predictable again.

    A draft model's prefill is lazy (`lag` tokens it has not seen, the whole prompt at the start of a request):
    the first drafted round pays it once. Drafting starts only when the time the predicted speed-up saves over
    the rest of the answer (the remaining budget, capped by the median length of recent answers) repays that
    catch-up, priced per token from measured catch-ups (`catch_up_ratio` x the per-token draft time until one
    is measured). On a long prompt with a short answer that keeps K at 0 instead of paying a prefill for
    nothing.
    """

    def __init__(self, *, latencies=None, prior_acceptance: list[float] | float = 0.6, k_max: int = 8,
                 decay: float = 0.95, prior_weight: float = 1.0, overlap: bool = False, probe_every: int = 8,
                 probe_k: int = 2, margin: float = 0.02, calibration_ks: tuple[int, ...] = (0, 2, 4),
                 window: int = 9, fast_decay: float = 0.7, drop: float = 0.3, catch_up_ratio: float = 0.15,
                 prior_reach: list[float] | None = None, probe_budget: float = 0.05,
                 p_min: float = DEFAULT_P_MIN):
        from .costmodel import Latencies  # noqa: F401  (documented type of `latencies`)

        self.k_max = check_k(k_max)
        # A model draft stops after a token its model gave less than p_min: positions it then leaves out count
        # as unreached (`reach`), so K is the most worth asking for, and the drafts actually made cost it.
        self.p_min = check_p_min(p_min)
        self.decay = decay
        self.prior_weight = prior_weight
        self.overlap = overlap
        self.margin = margin
        self.probe_every_base = probe_every
        self.probe_budget = probe_budget
        self.probe_every = probe_every
        self.probe_k = probe_k
        if isinstance(prior_acceptance, (int, float)):
            prior_acceptance = [float(prior_acceptance)] * self.k_max
        self.prior = list(prior_acceptance) + [prior_acceptance[-1]] * (self.k_max - len(prior_acceptance))
        # The prior enters as pseudo-rounds that age like real ones: it steers the first rounds and fades
        # as rounds accumulate (a fixed prior would cap how far real data can move the estimate).
        self.reached = [float(prior_weight)] * self.k_max
        self.accepted = [float(prior_weight) * p for p in self.prior]
        # A second, fast-fading copy of the counts watches for a sudden drop (the text stopped being
        # predictable): the slow counts are stable on ordinary noise, the fast ones react within a few rounds.
        self.fast_decay = fast_decay
        self.drop = drop
        self.reached_fast = list(self.reached)
        self.accepted_fast = list(self.accepted)
        # How far proposals reach: asked[i] rounds wanted position i, proposed[i] of them got a draft there.
        reach0 = list(prior_reach or [1.0])
        reach0 += [reach0[-1]] * (self.k_max - len(reach0))
        self.asked = [float(prior_weight)] * self.k_max
        self.proposed = [float(prior_weight) * min(max(r, 0.0), 1.0) for r in reach0[:self.k_max]]
        # Latency estimates: verify[n] in seconds, draft per token in seconds; None = not known yet.
        self.verify: dict[int, float] = {}
        self.draft_per_token: float | None = None
        # With a profile, its curves keep their shape and online rounds only rescale them: a round measures
        # verify(K+1) but never verify(1), so mixing raw online points with profiled ones would compare a
        # slow, long-context verify(K+1) with a fast verify(1) and push K down for no reason.
        self.profile_verify: dict[int, float] = {}
        self.verify_scale = 1.0
        self.draft_scale = 1.0
        if latencies is not None:
            self.profile_verify = {n: float(t) for n, t in enumerate(latencies.verify) if n >= 1 and t > 0}
            self.verify = dict(self.profile_verify)
            ks = [k for k in range(1, len(latencies.draft)) if latencies.draft[k] > 0]
            # all zeros: drafting is free (an n-gram lookup measured below the clock's resolution)
            self.draft_per_token = sum(latencies.draft[k] / k for k in ks) / len(ks) if ks else 0.0
        self.profile_draft_per_token = self.draft_per_token
        self.window = window
        self._windows: dict[str, deque] = {}
        self._calibration = [] if latencies is not None else [k for k in calibration_ks if k <= self.k_max]
        self.rounds_off = 0
        self.last_prediction = 1.0
        self.history: list[int] = []
        # Catch-up (the draft model's lazy prefill): seconds per fed token, measured; answer lengths seen.
        self.catch_up_ratio = catch_up_ratio
        self.catch_up_per_token: float | None = None
        self.answer_lengths: deque[int] = deque(maxlen=window)
        self._emitted = 0  # tokens of the current request so far (rounds observed since it began)
        self._budget: int | None = None  # the current request's max new tokens (its first `remaining`)
        self.waiting = 0  # rounds at K = 0 because the catch-up would not be repaid
        # An exact target runs a step of fewer rows padded to `min_rows` (the engine sets it from the target):
        # verifying n < min_rows tokens then costs what min_rows do, plain decoding included.
        self.min_rows = 1

    # -- estimates ------------------------------------------------------------------------------------
    def conditional_acceptance(self) -> list[float]:
        """Per-position conditional rates from the aged counts. A position with little weight left leans on
        the rate of the position before it (acceptance changes smoothly with depth). The slow counts unless
        the fast ones show the first position's rate moved by more than `drop` (a sudden drop, or a recovery
        seen by a probe): then the fast ones."""
        reach0 = self.reach()[0]
        slow = self._rates(self.accepted, self.reached, reach0)
        if reach0 < 0.9:
            # A drafter that proposes only sometimes (an n-gram lookup) swings between "no match" and "long
            # match" from round to round: that is its normal state, not a sudden change, so no fast copy.
            return slow
        fast = self._rates(self.accepted_fast, self.reached_fast, reach0)
        return fast if abs(fast[0] - slow[0]) > self.drop else slow

    def _rates(self, accepted: list[float], reached: list[float], reach0: float) -> list[float]:
        out = []
        for i in range(self.k_max):
            if i == 0:
                lean = self.prior[0]
            elif i == 1:
                # Position 0's rate counts the rounds a drafter proposed nothing (an n-gram lookup without a
                # match) as not accepted; position 1 is reached only after a proposal was accepted, so it leans
                # on the acceptance of a proposal, not on the match rate. Leaning on the match rate would lock
                # an n-gram drafter at K = 1 once position 1's counts have aged away (they only grow while K > 1).
                lean = min(out[0] / max(reach0, 1e-6), 1.0)
            else:
                lean = out[-1]
            out.append((accepted[i] + 0.5 * lean) / (reached[i] + 0.5))
        return out

    def survival(self) -> list[float]:
        out, s = [], 1.0
        for c in self.conditional_acceptance():
            s *= c
            out.append(s)
        return out

    def reach(self) -> list[float]:
        """P(a proposal reaches position i | K asked for it), from the aged counts."""
        return [(p + 0.5) / (a + 0.5) for p, a in zip(self.proposed, self.asked)]

    def latencies(self):
        """Expected latencies: the measured tables, each position charged as often as proposals reach it."""
        from .costmodel import Latencies

        if not self.verify or self.draft_per_token is None:
            return None
        known = sorted(self.verify)
        verify = [0.0]
        for n in range(1, self.k_max + 2):
            m = max(n, self.min_rows)
            verify.append(self.verify[m] if m in self.verify else _interpolate(self.verify, known, m))
        return Latencies.linear(self.draft_per_token, verify).expected(self.reach())

    # -- policy ---------------------------------------------------------------------------------------
    learns_from_shadow = True

    def begin_request(self, *, min_rows: int = 1) -> None:
        """The previous answer is finished: its length joins the recent answer lengths (the horizon a
        catch-up must be repaid over). `min_rows`: the target's row floor (see `latencies`)."""
        self.min_rows = min_rows
        # An answer cut at its token budget says only "at least this long": it would shorten the horizon of
        # the next request with a larger budget (the bench's 16-token warm-up kept the draft model off for its
        # first prompts: K = 0 on multi_turn where K = 3 ran 1.14x).
        if self._emitted and (self._budget is None or self._emitted < self._budget):
            self.answer_lengths.append(self._emitted)
        self._emitted, self._budget = 0, None

    def next_k(self, *, remaining: int | None = None, lag: int = 0) -> int:
        if self._emitted == 0 and self._budget is None:
            self._budget = remaining
        if self._calibration:
            k = self._calibration.pop(0)
        else:
            k = self._solve(remaining, lag)
        self.history.append(k)
        return k

    def _solve(self, remaining: int | None = None, lag: int = 0) -> int:
        from .costmodel import best_k

        lat = self.latencies()
        if lat is None:  # nothing measured yet (e.g. every calibration round was cut short)
            return self.probe_k
        # The margin guards against deciding on noise in rounds that pay for drafts; a drafter that proposes in
        # a fraction of rounds (an n-gram lookup) risks only those, so its margin shrinks with its reach.
        margin = self.margin * min(self.reach()[0], 1.0)
        k, predicted = best_k(self.survival(), lat, overlap=self.overlap, margin=margin)
        self.last_prediction = predicted
        if k > 0:
            if not self.repays(predicted, remaining, lag, lat.verify[1]):
                self.waiting += 1
                return 0
            self.rounds_off = 0
            self.probe_every = self.probe_every_base
            return k
        self.rounds_off += 1
        # A probe that must first feed the drafter a long context (the prompt, or answers decoded while
        # speculation was off, in a chat) waits until that costs at most `probe_budget` of the time spent
        # without speculation since the last probe: bounded overhead, and speculation still comes back.
        budget = max(lat.verify[1], self.probe_budget * self.rounds_off * lat.verify[1])
        if self.rounds_off >= self.probe_every and self.catch_up_cost(lag) <= budget:
            self.rounds_off = 0
            self.probe_every = min(self.probe_every * 2, 256)
            return self.probe_k
        return 0

    def catch_up_cost(self, lag: int) -> float:
        """Seconds the drafter needs to feed `lag` unseen tokens before drafting (estimated)."""
        if lag <= 2:  # a steady round feeds the target's last token (and perhaps one more): part of drafting
            return 0.0
        per = self.catch_up_per_token
        if per is None:
            per = self.catch_up_ratio * (self.draft_per_token or 0.0)
        return lag * per

    def repays(self, predicted: float, remaining: int | None, lag: int, t_plain: float) -> bool:
        """Does drafting at `predicted` speed-up save more than the catch-up costs, over the tokens left?"""
        cost = self.catch_up_cost(lag)
        if cost == 0.0 or remaining is None:
            return True
        horizon = remaining
        if self.answer_lengths:
            horizon = min(horizon, statistics.median(self.answer_lengths))
        return horizon * t_plain * (1.0 - 1.0 / predicted) > cost

    def observe_shadow(self, n_proposed: int, n_matched: int) -> None:
        """A free drafter's proposal made while speculation was off (K asked = k_max, nothing verified):
        `n_matched` of its `n_proposed` tokens turned out to be what the target emitted. Counts as a round for
        acceptance and reach; no latencies."""
        self._count(self.k_max, n_proposed, min(n_matched, n_proposed))

    def observe(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float, *,
                catch_up_s: float = 0.0, catch_up_tokens: int = 0, drafted: int | None = None) -> None:
        self._emitted += min(n_accepted, n_drafted) + 1
        if catch_up_tokens >= 16 and catch_up_s > 0:  # short feeds are dominated by per-call overhead
            self.catch_up_per_token = self._recent("catch_up", catch_up_s / catch_up_tokens)
        self._count(k, n_drafted, n_accepted)
        self._latencies(n_drafted, n_drafted if drafted is None else drafted, draft_s, verify_s)

    def _count(self, k: int, n_drafted: int, n_accepted: int) -> None:
        # Only rounds that asked for drafts age the counts: while speculation is off nothing is learnt about
        # acceptance (but from a free drafter's shadow proposals), and only a probe brings it back. A position
        # asked for but not proposed counts as not accepted (and, in `proposed`, as not reached).
        asked = min(k, self.k_max)
        for reached, accepted, decay in ((self.reached, self.accepted, self.decay),
                                         (self.reached_fast, self.accepted_fast, self.fast_decay)):
            for i in range(self.k_max if asked else 0):
                reached[i] *= decay
                accepted[i] *= decay
            for i in range(asked):
                if i > n_accepted:
                    break
                reached[i] += 1  # position i was asked for and every draft before it was accepted
                if i < n_accepted:
                    accepted[i] += 1
        for i in range(self.k_max if asked else 0):
            self.asked[i] *= self.decay
            self.proposed[i] *= self.decay
        for i in range(asked):
            self.asked[i] += 1
            if i < n_drafted:
                self.proposed[i] += 1

    def _latencies(self, n_drafted: int, drafted: int, draft_s: float, verify_s: float) -> None:
        # Latencies: medians of the last few rounds. A round is a few milliseconds, so one preempted round on a
        # busy machine can take 10x its usual time; a mean would let that single spike switch speculation off.
        n = max(n_drafted + 1, self.min_rows)  # the rows the target ran
        if verify_s > 0 and n in self.profile_verify:
            self.verify_scale = self._recent("verify", verify_s / self.profile_verify[n])
            self.verify = {m: t * self.verify_scale for m, t in self.profile_verify.items()}
        elif verify_s > 0:
            self.verify[n] = self._recent(f"verify{n}", verify_s)
        if drafted > 0 and draft_s > 0:
            per = draft_s / drafted
            if self.profile_draft_per_token:  # (a free drafter's is 0: then measured rounds set it)
                self.draft_scale = self._recent("draft", per / self.profile_draft_per_token)
                self.draft_per_token = self.profile_draft_per_token * self.draft_scale
            else:
                self.draft_per_token = self._recent("draft", per)

    def _recent(self, key: str, value: float) -> float:
        """Add a measurement to its window; return the window's median."""
        window = self._windows.setdefault(key, deque(maxlen=self.window))
        window.append(value)
        return statistics.median(window)

    def __repr__(self) -> str:
        return f"AdaptiveK(k_max={self.k_max}, overlap={self.overlap}, p_min={self.p_min})"


def _interpolate(table: dict[int, float], known: list[int], n: int) -> float:
    """Verification time for an unmeasured length: linear between the nearest measured lengths, flat beyond."""
    lower = [m for m in known if m < n]
    upper = [m for m in known if m > n]
    if lower and upper:
        a, b = lower[-1], upper[0]
        return table[a] + (table[b] - table[a]) * (n - a) / (b - a)
    if lower and len(lower) >= 2:  # extrapolate with the slope of the last two points, never decreasing
        a, b = lower[-2], lower[-1]
        slope = max((table[b] - table[a]) / (b - a), 0.0)
        return table[b] + slope * (n - b)
    return table[(lower or upper)[-1 if lower else 0]]
