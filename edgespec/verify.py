"""The accept/reject rules of speculative decoding, as pure functions.

Given K drafted tokens and the target's K+1 next-token distributions (one per drafted position plus the
bonus position), each rule returns how many drafts to accept and the one token the target adds. They never
touch a model or a cache, and every random draw comes from the `torch.Generator` passed in, in a fixed order
(one uniform per examined draft, then one categorical draw), so a seeded run is reproducible whatever the
timing around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Verdict:
    """`n_accepted` drafts are kept, then `next_token` (the correction, or the bonus when all K pass)."""

    n_accepted: int
    next_token: int


def verify_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> Verdict:
    """Accept the longest prefix that equals the target's argmax; then add the target's own argmax.

    `target_logits` is [K+1, V]: row i is the target's prediction for draft position i, row K the bonus.
    """
    k = len(draft_tokens)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} target rows for {k} drafts, got {target_logits.shape[0]}")
    # numpy's argmax on the CPU rows (the device contract): torch's takes ~20x longer on one row of a 49k
    # vocabulary, and wakes its thread pool beside the model's own once a token. Ties and NaN: the first, in both.
    # (.float() and .cpu() return the tensor itself when it is already float32 on the CPU)
    return accept_greedy(draft_tokens, target_logits.detach().float().cpu().numpy().argmax(-1).tolist())


def accept_greedy(draft_tokens: list[int], choice: list[int]) -> Verdict:
    """The greedy rule on the target's argmax of each row (`choice`, K+1 of them)."""
    n, k = 0, len(draft_tokens)
    while n < k and draft_tokens[n] == choice[n]:
        n += 1
    return Verdict(n, choice[n])


def verify_sampling(
    draft_tokens: list[int],
    p_draft: torch.Tensor,
    p_target: torch.Tensor,
    generator: torch.Generator,
    guess: tuple[int, torch.Tensor] | None = None,
) -> Verdict:
    """Leviathan/Chen speculative sampling: the emitted tokens are distributed exactly as the target's.

    Draft x at position i is accepted with probability min(1, p_target[i, x] / p_draft[i, x]); at the first
    rejection the correction is drawn from the normalised residual max(0, p_target[i] - p_draft[i]); when all K
    pass, the bonus is drawn from p_target[K]. `p_draft` is [K, V], `p_target` is [K+1, V]; both are computed in
    float64 here so a ratio near 1 is not rounded the wrong way. Rows of another width than p_target's (a draft
    model with a smaller embedding over the same tokenizer) are widened with zeros (`common_width`).

    `guess` (token g, its draft distribution row [V]): the drafter's own sample for the bonus position (an
    overlapped drafter has already drafted on from it). When all K pass, g is judged by the same rule and is the
    bonus if accepted, else the bonus comes from the residual of p_target[K] and that row: still distributed as
    p_target[K], and g is kept as often as a draft is accepted, where an independent draw from p_target[K] would
    equal g only with probability sum_x p_target[K, x] * p_guess[x].
    """
    k = len(draft_tokens)
    if p_target.shape[0] != k + 1 or p_draft.shape[0] != k:
        raise ValueError(f"need {k} draft rows and {k + 1} target rows, got {p_draft.shape[0]} and {p_target.shape[0]}")
    p_target, p_draft = common_width(p_target.double(), p_draft.double())
    for i, x in enumerate(draft_tokens):
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if u < acceptance_probability(p_target[i, x].item(), p_draft[i, x].item()):
            continue
        return Verdict(i, _draw(residual_distribution(p_target[i], p_draft[i]), generator))
    if guess is not None:
        g, p_guess = guess[0], common_width(p_target[k], guess[1].double())[1]
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if u < acceptance_probability(p_target[k, g].item(), p_guess[g].item()):
            return Verdict(k, g)
        return Verdict(k, _draw(residual_distribution(p_target[k], p_guess), generator))
    return Verdict(k, _draw(p_target[k], generator))


def common_width(p_target: torch.Tensor, p_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both widened with zeros to the wider of the two. Two models over one tokenizer may have embeddings of
    different sizes (Qwen2.5-7B has 152,064 rows, Qwen2.5-0.5B 151,936, both past the tokenizer's 151,665): a
    token past a model's rows has probability zero under it, so the rule on the widened rows is still exact."""
    extra = p_target.shape[-1] - p_draft.shape[-1]
    if extra > 0:
        p_draft = torch.nn.functional.pad(p_draft, (0, extra))
    elif extra < 0:
        p_target = torch.nn.functional.pad(p_target, (0, -extra))
    return p_target, p_draft


def acceptance_probability(p_target_x: float, p_draft_x: float) -> float:
    """min(1, p_target(x) / p_draft(x)). A token the draft gave zero mass but the target did not is accepted
    (the ratio is infinite); a token both give zero mass is rejected."""
    if p_draft_x <= 0:
        return 1.0 if p_target_x > 0 else 0.0
    return min(1.0, p_target_x / p_draft_x)


def residual_distribution(p_target: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p_target - p_draft)), the distribution to correct from after a rejection.

    A residual of (numerically) zero mass means p_target <= p_draft everywhere, i.e. the two are equal and a
    rejection had probability ~0; p_target itself is then the right distribution.
    """
    residual = (p_target - p_draft).clamp_min(0)
    mass = residual.sum()
    return residual / mass if mass > 1e-12 else p_target


DRAW_BLOCK = 256  # `_draw` finds the block of this many tokens the uniform falls in, then the token in it


def _draw(dist: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn from `dist` (non-negative weights over the last axis of a 1-D tensor, any positive total)
    with one uniform from `generator`: the inverse of its cumulative sum, taken in float64. A token of zero weight
    is never drawn: its cumulative sum equals the one before it.

    In two levels: the sums of blocks of `DRAW_BLOCK` tokens (a vectorised pass), the block whose cumulative sum
    passes u x total, then the token inside it. A flat cumulative sum runs serially over every token: 57 us over
    SmolLM2's 49,152, 180 us over Qwen's 151,936 on an EPYC core (`torch.multinomial` took 1.27 ms); two levels
    take a fraction of that. The same distribution, and the same token for the same
    uniform wherever the sums are exact (tests/test_verify.py); elsewhere they differ only by rounding."""
    n = dist.shape[0]
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    whole = n - n % DRAW_BLOCK
    sums = dist[:whole].reshape(-1, DRAW_BLOCK).sum(1, dtype=torch.float64)
    if whole < n:
        sums = torch.cat([sums, dist[whole:].sum(0, dtype=torch.float64).view(1)])
    cdf = np.cumsum(sums.numpy())  # (numpy from here: torch's per-call cost is most of a small op's)
    x = u * cdf[-1]
    b = int(np.searchsorted(cdf, x, side="right"))
    if b >= len(cdf):  # u rounded up to the total: the last token of positive weight
        return _last_positive(dist, 0, n)
    start, end = b * DRAW_BLOCK, min((b + 1) * DRAW_BLOCK, n)
    inner = torch.cumsum(dist[start:end], 0, dtype=torch.float64).numpy()
    i = int(np.searchsorted(inner, x - (cdf[b - 1] if b else 0.0), side="right"))
    # (the block's own running sum can round below its sum in `cdf`: then its last token of positive weight)
    return start + i if i < end - start else _last_positive(dist, start, end)


def _last_positive(dist: torch.Tensor, start: int, end: int) -> int:
    return start + int(torch.nonzero(dist[start:end] > 0)[-1])
