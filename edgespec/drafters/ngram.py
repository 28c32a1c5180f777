"""Prompt-lookup drafting: no model, just copy what followed the last occurrence of the current n-gram.

It wins when the answer repeats its input (rewrites, code edits, retrieval answers) and costs microseconds.
Its proposals are deterministic, so in sampling mode the rule sees a one-hot p_draft, which keeps the output
distribution exactly the target's.

Drafting is free but verifying a wrong draft is not (on the Qwen 1.5B INT4 target each extra position costs
~15% of a plain step), so a weak match proposes little: a single-token match proposes nothing (n >= 2) and a
2-token match at most `weak_cap` tokens; a longer match proposes up to K. Replaying the greedy outputs of all
56 bench prompts (Qwen pair, 128 tokens) through the profile's verify latencies (scripts/ngram_sim.py,
docs/bench/ngram/), this beat the plain n=1..3 lookup at every fixed K >= 3 in every category (at K=5 rag
1.77x vs 1.67x of plain decoding, translation, with nothing to copy, 1.00x vs 0.90x) and trails it by 1-5% at
K = 1-2; at K=8 the old lookup lost up to 20%, this one nowhere.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .base import Draft, DrafterBase


class NgramDrafter(DrafterBase):
    name = "ngram"
    free = True  # microseconds a proposal, no state to roll back: the engine may consult it while K = 0

    def __init__(self, max_ngram: int = 5, min_ngram: int = 2, weak_ngram: int = 2, weak_cap: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.weak_ngram = weak_ngram  # a match this short or shorter proposes at most `weak_cap` tokens
        self.weak_cap = weak_cap
        self.description = f"n-gram prompt lookup (n={min_ngram}..{max_ngram})"
        self._ids: list[int] = []
        self._proposed: list[int] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self._ids = list(prompt_ids)
        self._proposed = []

    def reset(self) -> None:
        self._ids, self._proposed = [], []

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator, *, p_min: float = 0.0) -> Draft:
        # (`p_min` does not apply: a lookup has no confidence of its own; its stop is the match running out)
        self._proposed = self._lookup(k) if k > 0 else []
        return Draft(list(self._proposed))

    def commit(self, n_accepted: int, next_token: int) -> None:
        self._ids.extend(self._proposed[:n_accepted])
        self._ids.append(next_token)
        self._proposed = []

    def _lookup(self, k: int) -> list[int]:
        return lookup(self._ids, k, max_ngram=self.max_ngram, min_ngram=self.min_ngram,
                      weak_ngram=self.weak_ngram, weak_cap=self.weak_cap)


def lookup(ids: list[int], k: int, *, max_ngram: int = 5, min_ngram: int = 1, weak_ngram: int = 0,
           weak_cap: int = 0) -> list[int]:
    """The k tokens after the most recent earlier occurrence of the longest matching suffix n-gram of `ids`
    (at most `weak_cap` of them when that n-gram is `weak_ngram` tokens or shorter)."""
    n_ids = len(ids)
    for n in range(min(max_ngram, n_ids - 1), min_ngram - 1, -1):
        suffix = ids[n_ids - n:]
        first = suffix[0]
        # Scan backwards so the most recent occurrence wins: recent text predicts the next text best.
        for start in range(n_ids - n - 1, -1, -1):
            if ids[start] == first and ids[start:start + n] == suffix:
                follow = ids[start + n:start + n + (min(k, weak_cap) if n <= weak_ngram else k)]
                if follow:
                    return follow
    return []
