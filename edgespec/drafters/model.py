"""A drafter that runs a (smaller) causal LM: any `CausalLM` backend, torch or ONNX Runtime.

It decodes K tokens one at a time from its own cache, then crops that cache to the accepted length on
`commit`. Tokens committed but not yet in its cache (the prompt, the target's correction, or many tokens while
speculation was off) are fed in one batch at the next `propose`: a request that never drafts (K = 0 from the
profile) never pays the draft model's prefill. Such a catch-up is timed apart (`Draft.catch_up_s`) so K
policies do not mistake a prefill for a slow draft token.
"""

from __future__ import annotations

import time

import torch

from ..lm import CausalLM, TorchLM
from ..sampling import SamplingParams, probs_from_logits
from ..target import CachedPrefix
from .base import Draft

CATCH_UP = 2  # a first feed longer than this is a catch-up (timed apart), not part of drafting


class ModelDrafter:
    def __init__(self, lm: CausalLM, *, name: str = "model"):
        self.lm = lm
        self.name = name
        self.description = lm.description
        self.vocab_size = lm.vocab_size
        self.max_context = lm.max_context
        self._cache = CachedPrefix(lm)
        self._ids: list[int] = []  # committed context
        # Proposed tokens beyond the committed context, in order, with their p_draft rows (None when greedy).
        # The cache holds at most ids + chain[:-1]. The chain can run ahead of what the engine asked for
        # (`propose_ahead`, used to draft the next round while the target verifies this one).
        self._chain: list[int] = []
        self._rows: list[torch.Tensor | None] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self._ids = list(prompt_ids)
        self._chain, self._rows = [], []
        self._cache.trim(self._ids[:-1])  # keep what a previous request left in common; feed lazily

    def reset(self) -> None:
        self._ids, self._chain, self._rows = [], [], []
        self._cache.sync([])

    def prefill(self) -> None:
        """Take in the committed context now (all but its last token, which the first proposal feeds) instead of
        lazily at the first proposal. The overlapped engine calls it on the drafter's own thread while the target
        takes in the prompt, so the draft model's prefill costs no time of its own."""
        self._cache.sync(self._ids[:-1])

    @property
    def lag(self) -> int:
        """Committed tokens not yet in the draft model's cache (the next proposal feeds them first)."""
        return max(len(self._ids) - len(self._cache.ids), 0)

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        # The drafter cannot look past its own window; proposing less is always allowed.
        k = min(k, self.max_context - len(self._ids))
        if k <= 0:
            return Draft([])
        before = len(self._chain)
        catch_up_s, catch_up_tokens = self._extend(k, params, generator)
        rows = self._rows[:k]
        return Draft(list(self._chain[:k]), None if params.greedy else torch.stack(rows), catch_up_s, catch_up_tokens,
                     drafted=max(len(self._chain) - before, 0))

    def propose_ahead(self, total: int, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
        """Extend the chain to `total` tokens (as if everything proposed so far will be accepted). Returns how
        many tokens that drafted and the seconds of it spent catching up on unseen context."""
        before = len(self._chain)
        catch_up_s, _ = self._extend(min(total, self.max_context - len(self._ids)), params, generator)
        return max(len(self._chain) - before, 0), catch_up_s

    def peek(self, i: int) -> tuple[int, torch.Tensor | None] | None:
        """The chain's token at position `i` past the committed context and its draft distribution row (None
        when greedy); None when the chain does not reach that far. After `propose_ahead`, position K is the
        drafter's guess at the token the target adds to a round of K drafts."""
        return (self._chain[i], self._rows[i]) if i < len(self._chain) else None

    def _extend(self, total: int, params: SamplingParams, generator: torch.Generator) -> tuple[float, int]:
        """Grow the chain to `total` tokens; return the seconds spent catching up on unseen context and how
        many tokens that was."""
        catch_up_s, catch_up_tokens = 0.0, 0
        while len(self._chain) < total:
            context = self._ids + self._chain
            new = context[len(self._cache.ids):]
            # A steady round feeds 1-2 tokens first (the target's token, perhaps the last accepted draft);
            # more is context the drafter has not seen yet.
            start = time.perf_counter() if len(new) > CATCH_UP else 0.0
            logits = self._cache.feed(new, 1)[-1]
            if start:
                catch_up_s += time.perf_counter() - start
                catch_up_tokens += len(new)
            if params.greedy:
                token, row = int(logits.argmax()), None
            else:
                row = probs_from_logits(logits, params)
                token = int(torch.multinomial(row, 1, generator=generator))
            self._chain.append(token)
            self._rows.append(row)
        return catch_up_s, catch_up_tokens

    def commit(self, n_accepted: int, next_token: int) -> None:
        chain = self._chain
        if n_accepted < len(chain) and chain[n_accepted] == next_token:
            # The chain already went this way (it ran ahead and guessed the target's token): keep the rest.
            self._ids.extend(chain[: n_accepted + 1])
            self._chain, self._rows = chain[n_accepted + 1:], self._rows[n_accepted + 1:]
            return
        keep = len(self._ids) + n_accepted
        self._ids.extend(chain[:n_accepted])
        self._ids.append(next_token)
        self._chain, self._rows = [], []
        if len(self._cache.ids) > keep:
            self._cache.crop(keep)


def TorchDrafter(model, *, max_context: int | None = None) -> ModelDrafter:
    """A drafter running a transformers causal LM under PyTorch."""
    return ModelDrafter(TorchLM(model, max_context=max_context, name="draft"), name="torch")
