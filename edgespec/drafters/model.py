"""A drafter that runs a (smaller) causal LM: any `CausalLM` backend, torch or ONNX Runtime.

It decodes K tokens one at a time from its own cache, then crops that cache to the accepted length on
`commit`. Tokens committed but not yet in its cache (the target's correction, or many tokens while
speculation was off) are fed in one batch at the next `propose`.
"""

from __future__ import annotations

import torch

from ..lm import CausalLM, TorchLM
from ..sampling import SamplingParams, probs_from_logits
from ..target import CachedPrefix
from .base import Draft


class ModelDrafter:
    def __init__(self, lm: CausalLM, *, name: str = "model"):
        self.lm = lm
        self.name = name
        self.description = lm.description
        self.vocab_size = lm.vocab_size
        self.max_context = lm.max_context
        self._cache = CachedPrefix(lm)
        self._ids: list[int] = []
        self._proposed: list[int] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self._ids = list(prompt_ids)
        self._proposed = []
        self._cache.sync(self._ids[:-1])

    def reset(self) -> None:
        self._ids, self._proposed = [], []
        self._cache.sync([])

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        # The drafter cannot look past its own window; proposing less is always allowed.
        k = min(k, self.max_context - len(self._ids))
        self._proposed = []
        if k <= 0:
            return Draft([])
        rows = []
        logits = self._cache.feed(self._ids[len(self._cache.ids):], 1)[-1]
        for j in range(k):
            if params.greedy:
                token = int(logits.argmax())
            else:
                probs = probs_from_logits(logits, params)
                token = int(torch.multinomial(probs, 1, generator=generator))
                rows.append(probs)
            self._proposed.append(token)
            if j < k - 1:
                logits = self._cache.feed([token], 1)[-1]
        return Draft(list(self._proposed), torch.stack(rows) if rows else None)

    def commit(self, n_accepted: int, next_token: int) -> None:
        keep = len(self._ids) + n_accepted
        self._ids.extend(self._proposed[:n_accepted])
        self._ids.append(next_token)
        self._proposed = []
        if len(self._cache.ids) > keep:
            self._cache.crop(keep)


def TorchDrafter(model, *, max_context: int | None = None) -> ModelDrafter:
    """A drafter running a transformers causal LM under PyTorch."""
    return ModelDrafter(TorchLM(model, max_context=max_context, name="draft"), name="torch")
