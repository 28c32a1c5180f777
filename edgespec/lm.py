"""The causal-LM contract every backend implements, and the Torch implementation of it.

A `CausalLM` is a model plus its KV cache and nothing else: it appends tokens, returns their next-token
logits, and crops its cache back to a length. Targets and drafters are built on top of it (see
`edgespec.target` and `edgespec.drafters.model`), so a new backend (ONNX Runtime, ...) only has to
implement this small class. It knows nothing about sampling, speculation or tokenizers.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


def torch_description(device: torch.device, dtype: torch.dtype) -> str:
    """A torch model's `description`, e.g. "torch cpu bfloat16" (profiles are matched on it)."""
    return f"torch {device.type} {str(dtype).removeprefix('torch.')}"


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only model with its own KV cache.

    - `vocab_size`: rows of the logits (the embedding size, which may exceed the tokenizer's size).
    - `max_context`: the longest sequence (prompt + generated) the model can attend over.
    - `length`: how many tokens the cache holds now.
    - `feed(ids, logits_for)`: append `ids` to the cache and return float32 logits for the last
      `logits_for` of them, shape [logits_for, vocab_size] (logits_for=0 returns an empty tensor).
    - `crop(length)`: forget everything after the first `length` cached tokens.
    - `reset()`: empty the cache.
    - `description`: a short human string, e.g. "torch cpu float32".
    """

    vocab_size: int
    max_context: int
    description: str

    @property
    def length(self) -> int: ...

    def feed(self, ids: list[int], logits_for: int) -> torch.Tensor: ...

    def crop(self, length: int) -> None: ...

    def reset(self) -> None: ...


class TorchLM:
    """A transformers causal LM under PyTorch with a `DynamicCache` that can be cropped."""

    def __init__(self, model, *, max_context: int | None = None, name: str = "model"):
        from transformers import DynamicCache  # local: keep `import edgespec` light

        self._cache_cls = DynamicCache
        self.model = model.eval()
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(max_context or getattr(text_config, "max_position_embeddings", 0) or 2048)
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        self.description = torch_description(self.device, self.dtype)
        self._cache = None
        self._length = 0
        # transformers renamed `past_key_values` to `cache` in 5.x; accept either, so the GPU script runs on
        # whatever transformers the GPU machine's image carries.
        import inspect

        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._cache = self._cache_cls(config=self.model.config)
        self._length = 0

    @torch.inference_mode()
    def feed(self, ids: list[int], logits_for: int) -> torch.Tensor:
        if self._cache is None:
            self.reset()
        if not ids:
            return torch.empty(0, self.vocab_size)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            use_cache=True,
            # Only compute the lm_head rows we need: with a 150k vocabulary it is a large share of a step.
            logits_to_keep=max(logits_for, 1),
            **{self._cache_arg: self._cache},
        )
        # DynamicCache grows in place: the object we passed in now holds the new tokens too.
        self._length += len(ids)
        if logits_for == 0:
            return torch.empty(0, self.vocab_size)
        return out.logits[0, -logits_for:].float()

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} tokens to {length}")
        if length < self._length:
            self._cache.crop(length - self._length)  # transformers 5: a negative count of tokens to remove
            self._length = length
