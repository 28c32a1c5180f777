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
    - `min_rows`: a feed shorter than this runs as `min_rows` rows (1: plain; more: exact, see `exact_rows`).
    - `reserve(total)`: a request will hold `total` tokens (an exact cache sizes itself; others ignore it).
    """

    vocab_size: int
    max_context: int
    description: str
    min_rows: int

    def reserve(self, total: int) -> None: ...

    @property
    def length(self) -> int: ...

    def feed(self, ids: list[int], logits_for: int) -> torch.Tensor: ...

    def crop(self, length: int) -> None: ...

    def reset(self) -> None: ...


class TorchLM:
    """A transformers causal LM under PyTorch with a KV cache that can be cropped.

    `min_rows` (default 1) makes it exact: greedy output bitwise the same at every K (`--exact`). torch's
    CPU kernels round a row differently depending on how many rows a step has and how long the attended
    key/value sequence is. With `min_rows` > 1 the cache is a `StaticCache` of fixed length (every step attends
    over the same number of positions, the unused ones masked) and a step shorter than `min_rows` runs as
    `min_rows` rows (the last id repeated) and keeps its own. Measured on Qwen2.5 1.5B bf16 on this CPU:
    with a static cache, steps of 4 or more rows give every row bitwise the same logits whatever the split
    (2 or 3 rows do not); with the dynamic cache no row count does. `exact_rows` finds the row count on the
    machine at hand.
    """

    def __init__(self, model, *, max_context: int | None = None, name: str = "model", min_rows: int = 1):
        from transformers import (  # local: keep `import edgespec` light
            DynamicCache,
            StaticCache,
        )

        self._dynamic_cls, self._static_cls = DynamicCache, StaticCache
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
        self._ids: list[int] = []  # what the cache holds (a static cache that must grow is refilled from it)
        self._static_len = 0  # positions of the static cache (0: not allocated yet)
        self._min_rows = int(min_rows)
        # transformers renamed `past_key_values` to `cache` in 5.x; accept either, so the GPU script runs on
        # whatever transformers the GPU machine's image carries.
        import inspect

        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def length(self) -> int:
        return len(self._ids)

    @property
    def min_rows(self) -> int:
        return self._min_rows

    @min_rows.setter
    def min_rows(self, n: int) -> None:
        """1: plain (dynamic cache); more: exact (static cache, short steps padded). Drops the cache."""
        self._min_rows = int(n)
        self._cache, self._ids, self._static_len = None, [], 0

    def _bucket(self, total: int) -> int:
        """The static cache length for a sequence of `total` tokens: a power of two (at least 256), so that
        the same request always gets the same length and with it the same numbers."""
        need = total + self._min_rows
        return min(self.max_context, max(256, 1 << (need - 1).bit_length()))

    def reserve(self, total: int) -> None:
        """Size an exact cache for a request of `total` tokens (prompt + new tokens). A new length drops what
        is cached (rows computed against another length round differently); plain mode ignores it."""
        if self._min_rows > 1 and (length := self._bucket(total)) != self._static_len:
            self._static_len = length
            self._cache, self._ids = None, []

    def reset(self) -> None:
        if self._min_rows > 1:
            self._static_len = self._static_len or self._bucket(0)
            self._cache = self._static_cls(config=self.model.config, max_cache_len=self._static_len)
        else:
            self._cache = self._dynamic_cls(config=self.model.config)
        self._ids = []

    @torch.inference_mode()
    def feed(self, ids: list[int], logits_for: int) -> torch.Tensor:
        if self._cache is None:
            self.reset()
        if not ids:
            return torch.empty(0, self.vocab_size)
        n = len(ids)
        check_feed(n, logits_for, self.length, self.max_context)
        rows = max(n, self._min_rows)
        if self.length + rows > self.max_context:
            rows = n  # the context's last positions: no room to pad (exactness ends there)
        if self._min_rows > 1 and self.length + rows > self._static_len:
            # Outgrown (no `reserve`, or a longer request than reserved): refill a longer cache. Rows computed
            # against the old length would round differently from the ones computed from now on.
            kept = self._ids
            self._static_len = self._bucket(len(kept) + n)
            self.reset()
            if kept:
                self.feed(kept, 0)
        padded = [*ids, *[ids[-1]] * (rows - n)]
        input_ids = torch.tensor([padded], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            use_cache=True,
            # Only compute the lm_head rows we need: with a 150k vocabulary it is a large share of a step. An
            # exact step computes them for every row, so that the head runs on the same row count too.
            logits_to_keep=rows if self._min_rows > 1 else max(logits_for, 1),
            **{self._cache_arg: self._cache},
        )
        # The cache grows in place: the object we passed in now holds the new tokens too.
        if rows > n:
            self._cache.crop(n - rows)
        self._ids.extend(ids)
        if logits_for == 0:
            return torch.empty(0, self.vocab_size)
        logits = out.logits[0, :n]  # the step's own rows (all it kept when not exact), without the padding
        return logits[logits.shape[0] - logits_for:].float()

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")
        if length < self.length:
            self._cache.crop(length - self.length)  # transformers 5: a negative count of tokens to remove
            del self._ids[length:]


def check_feed(n: int, logits_for: int, length: int, max_context: int) -> None:
    """The arguments every `CausalLM.feed` refuses: logits asked for more rows than fed, or a feed past the context."""
    if not 0 <= logits_for <= n:
        raise ValueError(f"logits_for={logits_for} must be between 0 and {n}")
    if length + n > max_context:
        raise ValueError(f"{length + n} tokens exceed the model's context of {max_context}")


def feed_padded(lm, ids: list[int], logits_for: int) -> torch.Tensor:
    """Run a feed shorter than `lm.min_rows` as `min_rows` rows (the last id repeated) and keep only its own:
    the rows that matter then go through the same kernels as a verification of several tokens (`--exact`).
    For backends whose cache is cropped back to a length (`OnnxLM`, `LlamaCppLM`)."""
    n = len(ids)
    kept = lm.length + n
    logits = lm.feed([*ids, *[ids[-1]] * (lm.min_rows - n)], lm.min_rows)
    lm.crop(kept)
    return logits[:n][n - logits_for:] if logits_for else torch.empty(0, lm.vocab_size)


EXACT_ROW_COUNTS = (2, 4, 8)  # the row counts `exact_rows` tries, fewest first (a padded step costs more rows)
# `exact_rows` checks steps of up to this many rows, so an exact target's steps stay within it (the engine keeps
# K below it): past it a row count may take other kernels. Qwen2.5 1.5B Q4_K_M on llama.cpp, exact at 8 rows,
# computed 9- and 10-row steps differently (their leftover rows past a multiple of 4 take another path) and the
# 14-prompt --exact bench found 3 mismatches at K = 8 (2026-12-07).
EXACT_CHECKED_ROWS = 8


@torch.inference_mode()
def exact_rows(lm, counts: tuple[int, ...] = EXACT_ROW_COUNTS) -> int | None:
    """The fewest rows a step must have for `lm` to compute every row bitwise the same whatever the split: the
    first of `counts` under which 8 tokens fed as 1+1+1+2+3 give the logits of the same 8 in one step, or None.

    `lm` has a settable `min_rows` (`TorchLM`, `OnnxLM`); it is left at the answer (1 when None) and reset.
    Kernels choose their code path by shape, so this is measured on the machine and model at hand, not assumed;
    one random sequence is evidence, not proof, and `edgespec bench --exact` checks the real outputs.
    """
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, lm.vocab_size, (16 + EXACT_CHECKED_ROWS,), generator=g).tolist()
    prompt, tokens = ids[:16], ids[16:]
    found = None
    for count in counts:
        lm.min_rows = count
        lm.reserve(len(ids))
        lm.reset()
        lm.feed(prompt, 0)
        whole = lm.feed(tokens, len(tokens))
        lm.crop(len(prompt))
        parts = [lm.feed(tokens[i:j], j - i) for i, j in ((0, 1), (1, 2), (2, 3), (3, 5), (5, len(tokens)))]
        if torch.equal(torch.cat(parts), whole):
            found = count
            break
    lm.min_rows = found or 1
    lm.reset()
    return found
