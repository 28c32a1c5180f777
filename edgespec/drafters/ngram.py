"""Prompt-lookup drafting: no model, just copy what followed the last occurrence of the current n-gram.

It wins when the answer repeats its input (rewrites, code edits, retrieval answers) and costs microseconds.
Its proposals are deterministic, so in sampling mode the rule sees a one-hot p_draft, which keeps the output
distribution exactly the target's.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams
from .base import Draft


class NgramDrafter:
    name = "ngram"
    vocab_size = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.description = f"n-gram prompt lookup (n={min_ngram}..{max_ngram})"
        self._ids: list[int] = []
        self._proposed: list[int] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self._ids = list(prompt_ids)
        self._proposed = []

    def reset(self) -> None:
        self._ids, self._proposed = [], []

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        self._proposed = self._lookup(k) if k > 0 else []
        return Draft(list(self._proposed))

    def commit(self, n_accepted: int, next_token: int) -> None:
        self._ids.extend(self._proposed[:n_accepted])
        self._ids.append(next_token)
        self._proposed = []

    def _lookup(self, k: int) -> list[int]:
        """The k tokens after the most recent earlier occurrence of the longest matching suffix n-gram."""
        ids = self._ids
        n_ids = len(ids)
        for n in range(min(self.max_ngram, n_ids - 1), self.min_ngram - 1, -1):
            suffix = ids[n_ids - n:]
            first = suffix[0]
            # Scan backwards so the most recent occurrence wins: recent text predicts the next text best.
            for start in range(n_ids - n - 1, -1, -1):
                if ids[start] == first and ids[start:start + n] == suffix:
                    follow = ids[start + n:start + n + k]
                    if follow:
                        return follow
        return []
