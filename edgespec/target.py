"""The verifier side: a `Target` appends tokens, returns their logits in one pass, and rolls back.

`ModelTarget` turns any `CausalLM` backend (torch here, ONNX Runtime in `edgespec.onnx_lm`) into a target. It
keeps the token ids its cache holds, so a new prompt that extends the previous one (the next chat turn) only
prefills the new part. It does not sample or decide anything: that is `edgespec.verify` and the engine.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .lm import CausalLM, TorchLM


@runtime_checkable
class Target(Protocol):
    vocab_size: int
    max_context: int
    description: str

    @property
    def length(self) -> int: ...

    @property
    def min_rows(self) -> int:
        """Rows a short step runs as: 1, or more for an exact target (its short steps are padded, so the engine
        fills the padding with guesses and the policy prices a short step as `min_rows` rows)."""

    def reserve(self, total: int) -> None:
        """A request will hold `total` tokens (an exact target sizes its cache by it; others ignore it)."""

    def prefill(self, ids: list[int]) -> None:
        """Make the cache hold exactly `ids` (reusing any common prefix already cached)."""

    def verify(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` and return float32 logits [len(tokens), V]: row i predicts the token after tokens[i]."""

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""

    def reset(self) -> None:
        """Drop the cache."""


class CachedPrefix:
    """Token ids mirrored alongside a `CausalLM`'s cache, so prefixes can be reused and rollbacks checked."""

    def __init__(self, lm: CausalLM):
        self.lm = lm
        self.ids: list[int] = []

    def sync(self, ids: list[int]) -> None:
        """Bring the cache to exactly `ids`: crop to the longest common prefix, feed the rest (no logits)."""
        common = self.trim(ids)
        self.feed(list(ids[common:]), 0)

    def trim(self, ids: list[int]) -> int:
        """Crop the cache to its longest common prefix with `ids` (feeding nothing); return that length."""
        common = 0
        limit = min(len(self.ids), len(ids))
        while common < limit and self.ids[common] == ids[common]:
            common += 1
        if common == 0 or self.lm.length < common:
            self.lm.reset()
            common = 0
        else:
            self.lm.crop(common)
        self.ids = list(ids[:common])
        return common

    def feed(self, ids: list[int], logits_for: int) -> torch.Tensor:
        logits = self.lm.feed(ids, logits_for)
        self.ids.extend(ids)
        return logits

    def crop(self, length: int) -> None:
        self.lm.crop(length)
        del self.ids[length:]


class ModelTarget:
    """A `Target` backed by a `CausalLM`."""

    def __init__(self, lm: CausalLM):
        self.lm = lm
        self._cache = CachedPrefix(lm)
        self.vocab_size = lm.vocab_size
        self.max_context = lm.max_context
        self.description = lm.description

    @property
    def length(self) -> int:
        return self.lm.length

    @property
    def min_rows(self) -> int:
        """Rows a short step runs as (more than 1 for an exact target: see `TorchLM`, `OnnxLM`, `exact_rows`)."""
        return self.lm.min_rows

    def reserve(self, total: int) -> None:
        """Tell the backend a request will hold `total` tokens (an exact torch target sizes its cache by it)."""
        self.lm.reserve(total)

    def prefill(self, ids: list[int]) -> None:
        self._cache.sync(ids)

    def verify(self, tokens: list[int]) -> torch.Tensor:
        return self._cache.feed(tokens, len(tokens))

    def rollback(self, length: int) -> None:
        self._cache.crop(length)

    def reset(self) -> None:
        """Forget the cache (a benchmark wants every request to pay its own prefill)."""
        self._cache.sync([])


def TorchTarget(model, *, max_context: int | None = None) -> ModelTarget:
    """A target running a transformers causal LM under PyTorch on the model's own device and dtype."""
    return ModelTarget(TorchLM(model, max_context=max_context, name="target"))
