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
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p  # the crossing token has mass_before < top_p: kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
