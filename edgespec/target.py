"""The verifier side: a `Target` appends tokens, returns their logits in one pass, and rolls back.

`ModelTarget` turns any `CausalLM` backend (torch here, ONNX Runtime in `edgespec.onnx_lm`) into a target. It
keeps the token ids its cache holds, so a new prompt that extends the previous one (the next chat turn) only
prefills the new part. It does not sample or decide anything: that is `edgespec.verify` and the engine.

The device contract (one device for the rule): the rule runs on the CPU, on float32 rows, with the engine's CPU
`torch.Generator`s, whatever device the models run on. So `Target.verify` returns CPU float32 logits (a target
on a GPU copies its K+1 rows to the CPU once per round, in `ModelTarget.verify`), and a drafter's `p_draft` rows
are CPU float32 too (`edgespec.drafters.base`). Why the CPU rather than the target's device: the rule examines
the drafts one at a time (a uniform, a ratio, maybe a residual), so on a GPU each of its K+2 reads would wait for
the device, the drafter's rows from ONNX Runtime on the CPU would have to be copied up, and the draws would need
a generator per device; on the CPU it is one copy of [K+1, V] floats a round (~5 MB for a 152k vocabulary), which
is also the moment the host waits for the GPU's verification. scripts/gpu_check.py times that copy and the rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .errors import EdgespecError
from .lm import CausalLM, TorchLM


@runtime_checkable
class Target(Protocol):
    """What the engine verifies with. `verify` returns CPU float32 logits (the device contract above). A target
    may also have a `runner` (`edgespec.llamacpp_lm.Runner`): the one thread its steps must run on, where the
    engine then runs its whole loop."""

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
        """Append `tokens` and return float32 logits [len(tokens), V] on the CPU, whatever device the model runs
        on: row i predicts the token after tokens[i]."""

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""

    def reset(self) -> None:
        """Drop the cache."""

    def synchronize(self) -> None:
        """Wait until the device has done all the work queued so far (nothing to wait for on the CPU). A GPU runs
        what it is given after the call that gave it has returned: the engine calls this before it reads its
        clock, so `prefill_ms`, `verify_ms` and the costs auto K learns from are the device's time."""


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


def check_finite(value: float, description: str) -> None:
    """An error unless `value` is finite or -inf: `value` is a number the rule read off the target's rows that is
    NaN or +inf whenever any of them holds NaN or +inf (greedy: the sum of each row's maximum; sampling: the sum of
    the rows). A float16 model whose activations overflow computes NaN and inf, and the rule would then emit
    nonsense without a word. (-inf alone is a token a model rules out: allowed.)"""
    if value != value or value == float("inf"):
        raise EdgespecError(f"the target ({description}) computed logits that are not finite (inf or NaN): "
                            f"its activations overflow in this precision; run it in another one, e.g. "
                            f"--dtype bfloat16 or --dtype float32")


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """What waits for `device`'s queued work: `torch.cuda.synchronize` on a CUDA device, nothing elsewhere (a CPU
    backend, and ONNX Runtime, whose `run` returns when its outputs are ready)."""
    device = torch.device(device)
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return _nothing


def _nothing() -> None:
    pass


class ModelTarget:
    """A `Target` backed by a `CausalLM`. `synchronize` waits for the backend's device (`synchronizer`); the
    default waits for nothing, right for a CPU backend."""

    def __init__(self, lm: CausalLM, *, synchronize: Callable[[], None] = _nothing):
        self.lm = lm
        self.synchronize = synchronize
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

    @property
    def runner(self):
        """The one thread the backend's steps run on (`edgespec.llamacpp_lm.Runner`), or None: any thread."""
        return getattr(self.lm, "runner", None)

    def reserve(self, total: int) -> None:
        """Tell the backend a request will hold `total` tokens (an exact torch target sizes its cache by it)."""
        self.lm.reserve(total)

    def prefill(self, ids: list[int]) -> None:
        self._cache.sync(ids)

    def verify(self, tokens: list[int]) -> torch.Tensor:
        """The backend's logits, on the CPU in float32 (a no-op for a CPU backend; one copy a round on a GPU).
        The rule checks they are finite where it reads them (`check_finite`)."""
        logits = self._cache.feed(tokens, len(tokens))
        if type(logits) is not torch.Tensor or logits.dtype != torch.float32 or logits.device.type != "cpu":
            logits = logits.to("cpu", torch.float32)
        return logits

    def rollback(self, length: int) -> None:
        self._cache.crop(length)

    def reset(self) -> None:
        """Forget the cache (a benchmark wants every request to pay its own prefill)."""
        self._cache.sync([])


def TorchTarget(model, *, max_context: int | None = None) -> ModelTarget:
    """A target running a transformers causal LM under PyTorch on the model's own device and dtype."""
    lm = TorchLM(model, max_context=max_context, name="target")
    return ModelTarget(lm, synchronize=synchronizer(lm.device))
