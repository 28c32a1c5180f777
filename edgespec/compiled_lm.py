"""A compiled torch target (`--compile`): the forward pass under `torch.compile`, one graph per step width.

Eager transformers at batch 1 is launch-bound on a GPU (gpt-fast: Llama-7B fp16 on an A100, 25.5 tok/s eager,
107 tok/s compiled with a static cache). `CompiledTorchLM` is a `TorchLM` whose cache is one transformers
`StaticCache` of fixed length (allocated once: its tensors keep their addresses, which CUDA graphs need), whose
rollback is a length (`StaticCache.crop` moves a counter tensor, nothing is copied), and whose every step of up
to `max(widths)` tokens runs padded to one of a few fixed widths, so the compiled forward sees the same few
shapes forever: `warm_up` compiles them all up front (on CUDA `mode="reduce-overhead"` records one CUDA graph per
width) and nothing recompiles afterwards. Longer feeds (a prompt) run eagerly on the same cache, as transformers'
`generate` runs its prefill. The compile settings are transformers' `CompileConfig`.

It is exact in the `--exact` sense only if the compiled kernels give every row the same bits whatever the width,
which `lm.exact_rows` measures as for any backend (widths below `min_rows` are then not used).
"""

from __future__ import annotations

import time
import types

import torch

from .errors import EdgespecError
from .lm import TorchLM, check_feed, torch_description
from .policy import MAX_K

# Whether `--compile` is on when not given, on CUDA (it is always off on the CPU, where the default target is
# ONNX Runtime and inductor's CPU code is not measured to win). Off until scripts/gpu_check.py measures the
# compiled verify(n) beating the eager one on a GPU; then this one constant turns it on.
COMPILE_ON_CUDA_DEFAULT = False
# The widths a step is padded to: K + 1 rows for K = 0, 1, 2, 4, 8 and MAX_K run unpadded. Six graphs, under
# Dynamo's recompile limit of 8 (each model has its own: see `_fresh_step`).
COMPILE_WIDTHS = (1, 2, 3, 5, 9, MAX_K + 1)
# The static cache's length, which caps a compiled target's context: one length for every request (another
# would be a new shape, so a recompile), and every step attends over all of it, masked (longer costs each step).
COMPILE_CONTEXT = 4096
WARM_UP_CALLS = 3  # per width: compile, then (CUDA) cudagraph trees' warm-up run and recording run


def compile_settings(device: torch.device, backend: str = "inductor"):
    """transformers' `CompileConfig` for the step: one static graph per width (`dynamic=False`), no graph breaks
    (`fullgraph=True`: a model that breaks is an error at warm-up, not a slow path); CUDA graphs on CUDA
    (`reduce-overhead`), inductor's default mode on the CPU (CUDA graphs do not exist there)."""
    from transformers import CompileConfig

    mode = "reduce-overhead" if device.type == "cuda" else "default"
    return CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=mode)


def _step(model, input_ids, cache, cache_arg: str):
    return model(input_ids=input_ids, use_cache=True, **{cache_arg: cache})


def _fresh_step():
    """`_step` with a code object of its own. Dynamo keeps its compiled graphs, and counts recompiles against
    the limit of 8, per code object; `model.get_compiled_call` compiles `Module.__call__`, whose code every
    model in the process shares, so a second compiled model's widths (the GPU check's 1.5B and 7B shapes, a
    test's second runtime) would pass the limit, and with `fullgraph` the step would fail."""
    return types.FunctionType(_step.__code__.replace(), _step.__globals__, "compiled_step")


class CompiledTorchLM(TorchLM):
    """A `TorchLM` on a fixed-length `StaticCache` whose steps run compiled at a few fixed widths.

    `widths` and `context` default to `COMPILE_WIDTHS` and `COMPILE_CONTEXT` (read when built). `context` caps
    `max_context` (the cache is `context + max(widths)` long, so padding fits at the context's
    end too). Call `warm_up` before timing anything: the first call of each width compiles it.
    """

    def __init__(self, model, *, max_context: int | None = None, name: str = "model",
                 widths: tuple[int, ...] | None = None, context: int | None = None, backend: str = "inductor"):
        super().__init__(model, max_context=max_context, name=name)
        self.name = name
        self.max_context = min(self.max_context, int(context or COMPILE_CONTEXT))
        self.widths = tuple(sorted(set(widths or COMPILE_WIDTHS)))
        self._usable = self.widths
        self.description = torch_description(self.device, self.dtype) + " compiled"
        self.settings = compile_settings(self.device, backend)
        self._compiled = torch.compile(_fresh_step(), **self.settings.to_dict())
        self._cache = self._static_cls(config=model.config, max_cache_len=self.max_context + self.widths[-1])
        self._check_full_attention()
        self.warm_up_s: float | None = None  # how long `warm_up` took
        self._graphs_after_warm_up: int | None = None

    def _check_full_attention(self) -> None:
        """A sliding-window layer counts its length in a Python int, which Dynamo specialises on: every new
        length would recompile."""
        from transformers.cache_utils import StaticLayer

        kinds = {type(layer).__name__ for layer in self._cache.layers if type(layer) is not StaticLayer}
        if kinds:
            raise EdgespecError(f"--compile: this model has {', '.join(sorted(kinds))} cache layers (sliding-window "
                                f"attention), whose length would recompile the step every token; drop --compile")

    @property
    def min_rows(self) -> int:
        """Rows a one-token step runs as: the smallest width in use."""
        return self._usable[0]

    @min_rows.setter
    def min_rows(self, n: int) -> None:
        """Steps of fewer than `n` rows run as the smallest width of at least `n` (`lm.exact_rows` sets this).
        The cache is emptied; nothing is reallocated or recompiled."""
        self._usable = tuple(w for w in self.widths if w >= n) or self.widths[-1:]
        self.reset()

    def reserve(self, total: int) -> None:
        """Nothing to size: the cache has one length for every request (a new length would recompile)."""

    def reset(self) -> None:
        self.crop(0)

    def crop(self, length: int) -> None:
        """Roll back to `length` tokens: the cache's length counter moves back; the rows past it are stale and
        masked, and the next step overwrites them."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} tokens to {length}")
        if length < self.length:
            self._cache.crop(length - self.length)
            del self._ids[length:]

    def width(self, n: int) -> int | None:
        """The width a step of `n` tokens runs at; None when it is longer than every width (run eagerly)."""
        return next((w for w in self._usable if w >= n), None)

    @torch.inference_mode()
    def feed(self, ids: list[int], logits_for: int) -> torch.Tensor:
        if not ids:
            return torch.empty(0, self.vocab_size)
        n = len(ids)
        check_feed(n, logits_for, self.length, self.max_context)
        width = self.width(n)
        if width is None:  # a prompt: eager, as transformers' generate runs its prefill, on the same cache
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device), use_cache=True,
                             logits_to_keep=max(logits_for, 1), **{self._cache_arg: self._cache})
            logits = out.logits[0]
        else:
            padded = torch.tensor([[*ids, *[ids[-1]] * (width - n)]], dtype=torch.long, device=self.device)
            if self.device.type == "cuda":
                # A new step for cudagraph trees: the previous step's outputs may now be overwritten (copied below).
                torch.compiler.cudagraph_mark_step_begin()
            logits = self._compiled(self.model, padded, self._cache, self._cache_arg).logits[0, :n]
            if width > n:
                self._cache.crop(n - width)  # the padding rows are not kept
        self._ids.extend(ids)
        if logits_for == 0:
            return torch.empty(0, self.vocab_size)
        # A copy: a CUDA graph's next replay overwrites its output buffer.
        return logits[logits.shape[0] - logits_for:].to(torch.float32, copy=True)

    @torch.inference_mode()
    def warm_up(self, report=None) -> float:
        """Compile every width now (each `WARM_UP_CALLS` times: on CUDA the later calls record its CUDA graph),
        reporting each and the total time to `report` (default: `edgespec.progress.report`); returns the seconds.
        The cache is empty afterwards."""
        if report is None:
            from .progress import report
        from torch._dynamo.utils import counters

        start = time.perf_counter()
        self.reset()
        # An eager first step allocates the static cache outside the compiled region, where transformers marks
        # its tensors as static addresses (inside a compiled region it cannot, and CUDA graphs would copy them).
        self.feed([0] * (self.widths[-1] + 1), 0)
        report(f"{self.name}: compiling its step for {len(self.widths)} widths ({', '.join(map(str, self.widths))} "
               f"rows; {self.settings.backend}, {self.settings.mode}), once per start")
        for i, width in enumerate(self.widths, 1):
            for _ in range(WARM_UP_CALLS):
                self._run_width(width)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the time said is the device's too
            report(f"{self.name}: width {width} compiled ({i}/{len(self.widths)}, {time.perf_counter() - start:.1f} s)")
        self.reset()
        self.warm_up_s = time.perf_counter() - start
        self._graphs_after_warm_up = counters["stats"]["unique_graphs"]
        report(f"{self.name}: compiled in {self.warm_up_s:.1f} s")
        return self.warm_up_s

    def _run_width(self, width: int) -> None:
        usable, self._usable = self._usable, (width,)
        try:
            kept = self.length
            self.feed([0] * width, 1)
            self.crop(kept)
        finally:
            self._usable = usable

    def graphs_since_warm_up(self) -> int:
        """Graphs Dynamo compiled, in the whole process, since `warm_up` ended (0 when nothing recompiled)."""
        from torch._dynamo.utils import counters

        if self._graphs_after_warm_up is None:
            raise RuntimeError("warm_up() has not run")
        return counters["stats"]["unique_graphs"] - self._graphs_after_warm_up


def compiled_lm(model, *, name: str = "target", report=None, **kwargs) -> CompiledTorchLM:
    """A warmed-up `CompiledTorchLM` over `model`; a model that does not compile is a one-line error."""
    lm = CompiledTorchLM(model, name=name, **kwargs)
    try:
        lm.warm_up(report)
    except Exception as err:  # Dynamo/inductor raise many types; any of them means this model cannot compile here
        if isinstance(err, EdgespecError):
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise EdgespecError(f"--compile: this model does not compile here ({type(err).__name__}: {first}); "
                            f"drop --compile") from err
    return lm


def eager_and_compiled(config, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       report=None, **kwargs) -> tuple[TorchLM, CompiledTorchLM]:
    """For the GPU check: an eager `TorchLM` and a warmed-up `CompiledTorchLM` over one model with random weights
    built from a transformers `config` (e.g. Qwen2.5 1.5B's) straight on `device` in `dtype`. `kwargs` go to
    `CompiledTorchLM` (widths, context, backend)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return TorchLM(model, name="eager"), compiled_lm(model, name="compiled", report=report, **kwargs)
