"""Expected speed of speculative decoding for each K, from acceptance and measured latencies. Pure.

Acceptance is given per draft position as survival probabilities: `survival[i]` = P(the first i+1 drafts of a
round are all accepted), which is what `SpecMetrics.acceptance_per_position()` measures (accepted at position
i over rounds that drafted position i). With an i.i.d. per-token rate a, survival[i] = a**(i+1).

One round with K drafts emits E(K) = 1 + sum_{i<K} survival[i] tokens on average. It costs
draft(K) + verify(K+1) when the draft and the target run one after the other. When drafting overlaps
verification (the drafter drafts its guess at the target's token and the next K while the target verifies),
the round costs max(draft(K+1), verify(K+1)), plus draft(K) again unless the whole block and the guess were
accepted (probability ~ survival[K]): the plain max(draft(K), verify(K+1)) assumes every overlapped draft
is used and over-predicted the measured gain by 30-37% on the Qwen pair (docs/bench/overlap/ in git before bac3fec).
Plain decoding costs verify(1) per token, so the expected speed-up is E(K) * verify(1) / cost(K).
K = 0 is plain decoding (speed-up 1 by definition).

A drafter may propose fewer than K tokens (an n-gram lookup with no or a weak match, a model drafter's early
stop): then survival counts a position it did not propose as not accepted, and `Latencies.expected(reach)`
charges each position j only with the probability `reach[j]` that a proposal reaches it, so a free drafter
that rarely proposes is neither over-credited nor over-charged.

No timing, no I/O: the profile (`edgespec.profiling`) and the policies (`edgespec.policy`) feed it numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def iid_survival(rate: float, k_max: int) -> list[float]:
    """Survival probabilities for an i.i.d. per-token acceptance rate."""
    return [rate ** (i + 1) for i in range(k_max)]


def expected_tokens(survival: Sequence[float], k: int) -> float:
    """E(K): tokens one round emits on average (accepted drafts plus the target's own token)."""
    if k > len(survival):
        raise ValueError(f"acceptance known for {len(survival)} positions, asked about K={k}")
    return 1.0 + sum(survival[:k])


@dataclass(frozen=True)
class Latencies:
    """Seconds. `draft[k]` = time to propose k tokens (draft[0] = 0); `verify[n]` = time for the target to
    process n tokens in one pass (verify[0] unused). Measured, not assumed linear: on CPUs verifying 2-3
    tokens can cost more than 4-9."""

    draft: Sequence[float]
    verify: Sequence[float]

    @property
    def k_max(self) -> int:
        return min(len(self.draft) - 1, len(self.verify) - 2)


    def expected(self, reach: Sequence[float] | None) -> Latencies:
        """Expected costs when the drafter's proposal reaches position j (has more than j tokens) with
        probability reach[j] when asked for more: drafting and verifying position j are paid only then."""
        if reach is None or all(r >= 1.0 for r in reach):
            return self
        n = min(len(self.draft), len(self.verify) - 1)
        draft, verify = [0.0], [self.verify[0], self.verify[1]]
        for j in range(n - 1):
            r = min(max(reach[min(j, len(reach) - 1)], 0.0), 1.0)  # beyond the list: its last value
            draft.append(draft[-1] + r * (self.draft[j + 1] - self.draft[j]))
            verify.append(verify[-1] + r * (self.verify[j + 2] - self.verify[j + 1]))
        return Latencies(draft, verify)

    @classmethod
    def linear(cls, t_draft: float, t_verify: Sequence[float]) -> Latencies:
        """Draft cost proportional to K (a per-token figure), verification from a table."""
        return cls([k * t_draft for k in range(len(t_verify) - 1)], list(t_verify))


def round_cost(lat: Latencies, k: int, *, overlap: bool = False, survival: Sequence[float] | None = None) -> float:
    if k == 0:
        return lat.verify[1]
    d, v = lat.draft[k], lat.verify[k + 1]
    if not overlap:
        return d + v
    ahead = lat.draft[k + 1] if k + 1 < len(lat.draft) else d * (k + 1) / k
    return max(ahead, v) + (1.0 - _hit(survival, k)) * d


def _hit(survival: Sequence[float] | None, k: int) -> float:
    """P(all K drafts and the guess at the target's next token are accepted): survival[K], extrapolated
    with the last conditional rate when only K positions are known; 1 when unknown (the optimistic form)."""
    if survival is None:
        return 1.0
    if k < len(survival):
        return survival[k]
    if k >= 2 and survival[k - 2] > 0:
        return survival[k - 1] * survival[k - 1] / survival[k - 2]
    return survival[k - 1] ** ((k + 1) / k)


def speedup(survival: Sequence[float], lat: Latencies, k: int, *, overlap: bool = False) -> float:
    """Expected tokens/s with K drafts over tokens/s of plain decoding."""
    if k == 0:
        return 1.0
    return expected_tokens(survival, k) * lat.verify[1] / round_cost(lat, k, overlap=overlap, survival=survival)


def speedups(survival: Sequence[float], lat: Latencies, *, overlap: bool = False) -> list[float]:
    """speedup for K = 0..k_max (limited by what both the latencies and the acceptance cover)."""
    k_max = min(lat.k_max, len(survival))
    return [speedup(survival, lat, k, overlap=overlap) for k in range(k_max + 1)]


def best_k(survival: Sequence[float], lat: Latencies, *, overlap: bool = False, margin: float = 0.0) -> tuple[int, float]:
    """The K with the largest expected speed-up, and that speed-up; K = 0 unless some K beats 1 + margin."""
    table = speedups(survival, lat, overlap=overlap)
    k = max(range(len(table)), key=lambda i: table[i])
    if table[k] <= 1.0 + margin:
        return 0, 1.0
    return k, table[k]
