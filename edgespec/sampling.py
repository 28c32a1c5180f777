"""Sampling parameters and the one function that turns logits into a distribution.

Draft and target both go through `probs_from_logits`, so the distributions the speculative rule compares are
shaped by the same temperature, top-k and top-p. Greedy decoding (temperature 0) never builds a distribution:
it is an argmax, done by the rule in `edgespec.verify`. This module draws no random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import EdgespecError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` means greedy; `top_k == 0` and `top_p == 1` mean no filter."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise EdgespecError(f"temperature {self.temperature} is negative; use 0 for greedy or a value > 0")
        if self.top_k < 0:
            raise EdgespecError(f"top-k {self.top_k} is negative; use 0 to disable it or a positive count")
        if not 0 < self.top_p <= 1:
            raise EdgespecError(f"top-p {self.top_p} is outside (0, 1]; use 1 to disable it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> float32 probabilities [..., V] after temperature, top-k and top-p (in that order).

    top-p keeps the smallest set of most likely tokens whose mass reaches `top_p` (the token that crosses the
    threshold included), as transformers' TopPLogitsWarper does. For greedy params the result is the one-hot
    argmax, so callers that want a distribution always get one.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        probs = _top_p(probs, params.top_p)
    return probs


TOP_P_CANDIDATES = 1024  # top-p looks among this many most likely tokens first (a whole sort only when needed)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token after the one whose running mass (most likely first) reaches `top_p`, and renormalise.
    Sorting a 152k vocabulary takes ~14 ms a row on a CPU core, several rows a round, so the nucleus is looked
    for among the `TOP_P_CANDIDATES` most likely tokens first; it is there whenever their mass reaches `top_p`
    (bitwise the whole sort's result for distinct probabilities: the same values summed in the same order;
    where tokens tie at the cut, which of them are kept depends on the order topk or sort leaves ties in, as
    it already did between sorts: as many tokens, the same mass up to rounding)."""
    vocab = probs.shape[-1]
    whole = TOP_P_CANDIDATES >= vocab
    if not whole:
        top, order = torch.topk(probs, TOP_P_CANDIDATES, dim=-1)
        running = torch.cumsum(top, dim=-1)
        whole = not bool((running[..., -1] >= top_p).all())
    if whole:
        top, order = torch.sort(probs, dim=-1, descending=True)
        running = torch.cumsum(top, dim=-1)
    keep = (running - top) < top_p  # the crossing token has mass before it < top_p: kept
    kept = torch.zeros_like(probs).scatter(-1, order, top * keep)
    return kept / kept.sum(-1, keepdim=True)
