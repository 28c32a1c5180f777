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
        # Where each n-gram (min_ngram <= n <= max_ngram) of `_ids` last started, over the n-grams that end before
        # index `_indexed_to` (at most the last token's: a match then always has a token after it). Scanning the
        # context instead cost a proposal 80 us at 600 tokens and grew with every turn of a chat, paid each round
        # while K = 0 (the engine consults a free drafter in the shadow).
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed_to = 0

    def begin(self, prompt_ids: list[int]) -> None:
        ids = list(prompt_ids)
        if ids[:len(self._ids)] != self._ids:  # not a continuation of what is indexed (a new chat, an edit)
            self._last, self._indexed_to = {}, 0
        self._ids = ids
        self._proposed = []

    def reset(self) -> None:
        self._ids, self._proposed = [], []
        self._last, self._indexed_to = {}, 0

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator, *, p_min: float = 0.0) -> Draft:
        # (`p_min` does not apply: a lookup has no confidence of its own; its stop is the match running out)
        self._proposed = self._lookup(k) if k > 0 else []
        return Draft(list(self._proposed))

    def commit(self, n_accepted: int, next_token: int) -> None:
        self._ids.extend(self._proposed[:n_accepted])
        self._ids.append(next_token)
        self._proposed = []

    def _lookup(self, k: int) -> list[int]:
        """`lookup(self._ids, k, ...)` (the same answer, tested), from the index in O(max_ngram)."""
        ids, last = self._ids, self._last
        n_ids = len(ids)
        # register every start s of an n-gram that ends before the last token: s + n <= n_ids - 1
        for end in range(self._indexed_to, n_ids - 1):  # `end`: the index of the n-gram's last token
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                last[tuple(ids[end - n + 1:end + 1])] = end - n + 1
        self._indexed_to = max(self._indexed_to, n_ids - 1)
        for n in range(min(self.max_ngram, n_ids - 1), self.min_ngram - 1, -1):
            start = last.get(tuple(ids[n_ids - n:]))
            if start is not None:
                follow = ids[start + n:start + n + (min(k, self.weak_cap) if n <= self.weak_ngram else k)]
                if follow:  # (empty only with a weak cap of 0: then a shorter match is looked for, as in `lookup`)
                    return follow
        return []


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
