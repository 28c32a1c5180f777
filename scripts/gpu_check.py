"""The GPU check: one command on a lent GPU machine that measures what edgespec's GPU path has never run on.

Sections, in order (each writes gpu-check.json and gpu-check.md to --out before the next one starts; a section
that fails is recorded with its error and the next one runs; a time guard skips or stops what would not finish):

  versions     torch, CUDA, the GPU, transformers, ONNX Runtime and its providers, the builder
  engine       the engine on the device with tiny random models: greedy and T = 0.7, K = 0 and 4, sequential
               and overlapped, drafters none / n-gram / ONNX int4 on the CPU / ONNX fp16 on the GPU / torch on
               the GPU; greedy output identical to target-only, no drafter dropped
  rule         the device contract's cost: copying [9, 152k] logits to the CPU, and the rule on them
  verify       verify(n), n = 1..9, eager, of Qwen2.5 1.5B and 7B shapes in bf16 (random weights from the
               configs: no downloads); the engine's prefill_ms / verify_ms against CUDA events; the memory budget's
               estimate against what torch allocated
  draft        the INT4 ONNX draft (Qwen2.5 0.5B shape) on the CPU: ms per drafted token alone and with the 1.5B
               target verifying beside it on the GPU
  ort_cuda     ONNX Runtime's CUDA provider: which nodes it took (ORT's profiler) and ms per token
  compiled     verify(n) of the compiled target (--compile, edgespec.compiled_lm; skipped where it is absent)
  cost_model   the predicted speed-up per K from those latencies and the acceptance measured on the CPU with the
               real Qwen2.5-Coder weights (the shipped profile)

`--smoke` runs every section on the CPU with tiny shapes (tests/test_gpu_check.py). docs/gpu.md says how the
device run is prepared (no internet there: the onnxruntime-genai wheel is carried) and run:

    EDGESPEC_CACHE=/tmp/es PYTHONPATH=/tmp/site:. timeout 500 python3 scripts/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

QWEN = {  # the published Qwen2.5 shapes
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
# Same code paths, CPU-sized. Head size 32: ONNX Runtime's attention wants a multiple of 16.
TINY = {
    "0.5b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "7b": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}
# The engine section's pair: tiny on any device, peaked distributions (large init) so greedy is far from ties.
ENGINE_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, initializer_range=0.3)
ENGINE_DRAFTERS = ("none", "ngram", "onnx-int4-cpu", "onnx-fp16-gpu", "torch-gpu")
COMPILED_WIDTHS = (1, 2, 3, 5, 9)
PROFILE_GLOB = str(ROOT / "edgespec" / "data" / "profiles" / "*qwen2.5-coder-1.5b-onnx.toml")


class OutOfTime(Exception):
    """The time guard: the run's budget is spent."""


@dataclass
class Check:
    """The run's settings and its results so far."""

    out: Path
    smoke: bool
    device: str
    dtype: torch.dtype
    shapes: dict
    context: int
    repeats: int
    new_tokens: int
    draft_threads: list[int]
    deadline: float
    work: Path
    result: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)  # shape name -> model on the device, kept for later sections

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def need(self, seconds: float, what: str) -> None:
        if self.left() < seconds:
            raise OutOfTime(f"{what}: {self.left():.0f} s left, about {seconds:.0f} s needed")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- helpers


def qwen(shape: dict, device: str, dtype: torch.dtype, seed: int = 0):
    """A Qwen2 model with random weights from a config, built on `device` directly (7B in seconds)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{"max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                            "bos_token_id": 1, "eos_token_id": 2, **shape})
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def save_checkpoint(model, path: Path) -> Path:
    """The model and a word-level tokenizer of its vocabulary's size (the ONNX builder wants one beside it)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    vocab = model.config.vocab_size
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(min(vocab, 1000))}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", bos_token="t1").save_pretrained(path)
    return path


def median_ms(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(times), 3)


def target_for(lm, device: str):
    from edgespec.target import ModelTarget, synchronizer

    return ModelTarget(lm, synchronize=synchronizer(device))


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    """Random ids with a repeated tail, so prompt lookup has something to find."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, vocab) for _ in range(max(n - 16, 8))]
    return (ids + ids[-8:] * 2)[:n]


def version_of(*dists: str) -> str | None:
    import importlib.metadata

    for dist in dists:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return None


# ---------------------------------------------------------------------------------------------- sections


def versions(c: Check, data: dict) -> None:
    import onnxruntime as ort

    from edgespec.hardware import describe
    from edgespec.onnx_lm import cuda_provider_problem

    data.update(python=platform.python_version(), platform=platform.platform(), cpu_count=os.cpu_count(),
                torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                transformers=version_of("transformers"), onnxruntime=ort.__version__,
                ort_providers=ort.get_available_providers(),
                builder=version_of("onnxruntime-genai", "onnxruntime-genai-cuda"), device=c.device,
                dtype=str(c.dtype).removeprefix("torch."))
    if c.cuda:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        data.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_free_gib=round(free / 2**30, 1),
                    gpu_total_gib=round(total / 2**30, 1), integrated=bool(getattr(props, "is_integrated", False)))
    data["ort_cuda"] = ("available" if "CUDAExecutionProvider" in ort.get_available_providers()
                        else f"not available: {cuda_provider_problem(ort)}")
    hw = describe().to_dict()
    data["hardware"] = {k: hw[k] for k in ("cpu_model", "cores_usable", "memory_total", "unified_memory", "jetson")}
    with contextlib.suppress(OSError):
        head = (ROOT / ".git" / "HEAD").read_text().strip()
        data["commit"] = (ROOT / ".git" / head[5:]).read_text().strip() if head.startswith("ref: ") else head


def _engine_models(c: Check) -> dict:
    """The engine section's pair: a tiny target on the device, a close draft (the target with a little noise) on
    the device and saved, with its ONNX exports (int4 for the CPU, fp16 for the CUDA provider)."""
    from edgespec.convert import hf_to_onnx

    if "engine" in c.models:
        return c.models["engine"]
    target = qwen(ENGINE_SHAPE, c.device, c.dtype)
    draft = qwen(ENGINE_SHAPE, "cpu", torch.float32)
    draft.load_state_dict({k: v.float().cpu() for k, v in target.state_dict().items()})
    torch.manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std())
    hf = save_checkpoint(draft, c.work / "engine-draft")
    pair = {"target": target, "draft": draft.to(device=c.device, dtype=c.dtype), "hf": hf,
            "int4": hf_to_onnx(hf, precision="int4", last_logits_only=True),
            "fp16_cuda": hf_to_onnx(hf, precision="fp16", execution_provider="cuda", last_logits_only=True)}
    c.models["engine"] = pair
    return pair


def _engine_drafter(name: str, pair: dict, c: Check):
    from edgespec.drafters import ModelDrafter, NgramDrafter
    from edgespec.lm import TorchLM
    from edgespec.onnx_lm import OnnxLM

    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter()
    if name == "onnx-int4-cpu":
        return ModelDrafter(OnnxLM(pair["int4"], threads=min(4, os.cpu_count() or 1), name="draft"), name="int4")
    if name == "onnx-fp16-gpu":  # on the CPU provider in a smoke run: the same export, the same code
        return ModelDrafter(OnnxLM(pair["fp16_cuda"], device=c.device if c.cuda else "cpu", threads=1,
                                   name="draft"), name="fp16")
    return ModelDrafter(TorchLM(pair["draft"], name="draft"), name="torch")


def engine(c: Check, data: dict) -> None:
    from edgespec.engine import SpeculativeEngine
    from edgespec.lm import TorchLM
    from edgespec.policy import FixedK
    from edgespec.sampling import SamplingParams

    pair = _engine_models(c)
    prompt = prompt_ids(ENGINE_SHAPE["vocab_size"], 24)
    reference = SpeculativeEngine(target_for(TorchLM(pair["target"], name="target"), c.device)).run(
        prompt, max_new_tokens=c.new_tokens).token_ids
    runs, identical, total_greedy, failures = [], 0, 0, 0
    data.update(runs=runs, target_only=reference)
    for name in ENGINE_DRAFTERS:
        try:
            drafter = _engine_drafter(name, pair, c)
        except Exception as err:  # noqa: BLE001 - recorded: e.g. no CUDA provider for the fp16 ONNX draft
            runs.append({"drafter": name, "error": f"{type(err).__name__}: {err}"[:400]})
            failures += 1
            continue
        for overlap in (False, True):
            eng = SpeculativeEngine(target_for(TorchLM(pair["target"], name="target"), c.device), drafter,
                                    overlap=overlap)
            for temperature in (0.0, 0.7):
                for k in (0, 4) if name != "none" else (0,):
                    c.need(5, "engine runs")
                    row = {"drafter": name, "overlap": overlap, "temperature": temperature, "k": k}
                    try:
                        start = time.perf_counter()
                        steps = list(eng.generate(prompt, params=SamplingParams(temperature=temperature, seed=3),
                                                  max_new_tokens=c.new_tokens, policy=FixedK(k)))
                        wall = time.perf_counter() - start
                    except Exception as err:  # noqa: BLE001 - recorded, the next run goes on
                        row["error"] = f"{type(err).__name__}: {err}"[:400]
                        failures += 1
                        runs.append(row)
                        continue
                    tokens = [t for s in steps for t in s.tokens]
                    row.update(tokens=len(tokens), accepted=sum(s.n_accepted for s in steps),
                               drafted=sum(s.n_drafted for s in steps),
                               notices=[s.notice for s in steps if s.notice], tok_s=round(len(tokens) / wall, 1),
                               prefill_ms=round(steps[0].prefill_ms, 3),
                               verify_ms=round(sum(s.verify_ms for s in steps), 3),
                               draft_ms=round(sum(s.draft_ms for s in steps), 3))
                    if temperature == 0:
                        total_greedy += 1
                        row["identical"] = tokens == reference
                        identical += row["identical"]
                    runs.append(row)
    data.update(greedy_identical=f"{identical}/{total_greedy}", failures=failures,
                notices=sum(len(r.get("notices", [])) for r in runs))


def rule(c: Check, data: dict) -> None:
    """The device contract's price: [9, V] logits from the target's device to the CPU, and the rule on them."""
    from edgespec.drafters.base import Draft
    from edgespec.engine import judge
    from edgespec.sampling import SamplingParams

    vocab = c.shapes["1.5b"]["vocab_size"]
    logits = torch.randn(9, vocab, device=c.device, dtype=c.dtype) * 4
    data["vocab"] = vocab
    data["copy_float32_ms"] = median_ms(lambda: logits.float().to("cpu", torch.float32), 30, c.sync)
    data["copy_then_float_ms"] = median_ms(lambda: logits.to("cpu").float(), 30, c.sync)
    cpu = logits.float().cpu()
    gen = torch.Generator().manual_seed(0)
    draft = Draft([int(t) for t in cpu[:8].argmax(-1)])
    rows = torch.softmax(cpu[:8] / 0.7 + torch.randn(8, vocab), -1)
    data["greedy_ms"] = median_ms(lambda: judge(draft, cpu, SamplingParams(), gen), 30)
    data["sampling_one_hot_ms"] = median_ms(lambda: judge(draft, cpu, SamplingParams(temperature=0.7), gen), 30)
    model_draft = Draft(draft.tokens, p_draft=rows)
    data["sampling_rows_ms"] = median_ms(lambda: judge(model_draft, cpu, SamplingParams(temperature=0.7), gen), 30)
    data["sampling_top_p_ms"] = median_ms(
        lambda: judge(model_draft, cpu, SamplingParams(temperature=0.7, top_p=0.9), gen), 30)
    data["finite_check_ms"] = median_ms(lambda: float(cpu.sum()), 30)


class EventTimed:
    """A `CausalLM` wrapper recording each feed's device time: CUDA events around it on a GPU (the host clock
    on the CPU, where the two are the same thing)."""

    def __init__(self, lm, cuda: bool):
        self.lm, self.cuda, self.feeds = lm, cuda, []
        self.vocab_size, self.max_context, self.description = lm.vocab_size, lm.max_context, lm.description
        self.min_rows = lm.min_rows

    @property
    def length(self) -> int:
        return self.lm.length

    def reserve(self, total: int) -> None:
        self.lm.reserve(total)

    def crop(self, length: int) -> None:
        self.lm.crop(length)

    def reset(self) -> None:
        self.lm.reset()

    def feed(self, ids, logits_for):
        if not self.cuda:
            t = time.perf_counter()
            out = self.lm.feed(ids, logits_for)
            self.feeds.append((logits_for, (time.perf_counter() - t) * 1000))
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.lm.feed(ids, logits_for)
        end.record()
        self.feeds.append((logits_for, (start, end)))
        return out

    def device_ms(self) -> list[tuple[int, float]]:
        if self.cuda:
            torch.cuda.synchronize()
            return [(n, s.elapsed_time(e)) for n, (s, e) in self.feeds]
        return list(self.feeds)


def _timings(c: Check, model, vocab: int) -> dict:
    """The engine's prefill_ms and verify_ms against the device's own time for the same feeds; once with the
    target's synchronize (as edgespec runs) and once without (as it ran before: launches only)."""
    from edgespec.drafters import NgramDrafter
    from edgespec.engine import SpeculativeEngine
    from edgespec.lm import TorchLM
    from edgespec.policy import FixedK
    from edgespec.target import ModelTarget, synchronizer

    out = {}
    prompt = prompt_ids(vocab, c.context)
    for label, sync in (("synchronised", synchronizer(c.device)), ("not_synchronised", lambda: None)):
        lm = EventTimed(TorchLM(model, name="target"), c.cuda)
        steps = list(SpeculativeEngine(ModelTarget(lm, synchronize=sync), NgramDrafter()).generate(
            prompt, max_new_tokens=c.new_tokens, policy=FixedK(4)))
        feeds = lm.device_ms()
        prefill = sum(ms for n, ms in feeds if n == 0)
        verifies = [ms for n, ms in feeds if n > 0]
        engine_verify = [s.verify_ms for s in steps]
        out[label] = {"prefill_engine_ms": round(steps[0].prefill_ms, 3), "prefill_device_ms": round(prefill, 3),
                      "verify_engine_ms": round(sum(engine_verify), 3), "verify_device_ms": round(sum(verifies), 3),
                      "first_round_verify_engine_ms": round(engine_verify[0], 3),
                      "rounds": len(steps),
                      "rounds_engine_below_device": sum(e < d * 0.98 for e, d in zip(engine_verify, verifies))}
    return out


def _memory(c: Check, model, baseline: int) -> dict:
    """The budget's estimate for this model at the context measured, against what torch allocated."""
    from edgespec import budget

    config = model.config.to_dict()
    dtype_bytes = torch.finfo(c.dtype).bits // 8
    estimate = {"weights": sum(p.numel() for p in model.parameters()) * dtype_bytes,
                "kv_at_context": budget.kv_bytes(config, c.context + 16, dtype_bytes),
                "working_memory_margin": budget.TORCH_WORKSPACE,
                "kv_at_32768": budget.kv_bytes(config, 32768, dtype_bytes)}
    if not c.cuda:
        return {"estimate_bytes": estimate, "measured": "not on the CPU"}
    return {"estimate_bytes": estimate, "weights_allocated": baseline,
            "peak_beyond_weights": torch.cuda.max_memory_allocated() - baseline,
            "reserved": torch.cuda.memory_reserved()}


def verify(c: Check, data: dict) -> None:
    from edgespec.lm import TorchLM
    from edgespec.profiling import measure_verify

    for name in ("1.5b", "7b"):
        c.need(40 if not c.smoke else 2, f"verify {name}")
        shape = c.shapes[name]
        if c.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        model = qwen(shape, c.device, c.dtype)
        c.sync()
        entry = {"build_s": round(time.perf_counter() - start, 1)}
        baseline = torch.cuda.memory_allocated() if c.cuda else 0
        context = prompt_ids(shape["vocab_size"], c.context)
        target = target_for(TorchLM(model, name="target"), c.device)
        med, spread = measure_verify(target, context, range(1, 10), c.repeats)
        entry.update(verify_ms=med, verify_spread_ms=spread, memory=_memory(c, model, baseline))
        if name == "1.5b":
            entry["timings"] = _timings(c, model, shape["vocab_size"])
            c.models["1.5b"] = model  # the draft section verifies beside it
        data[name] = entry
        c.result["verify_tables"] = {**c.result.get("verify_tables", {}), f"{name}-eager": med}
        if name != "1.5b":
            del model, target


def _draft_onnx(c: Check) -> Path:
    """The INT4 draft (Qwen2.5 0.5B shape) as the runtime builds drafters; a smoke run reuses the engine's."""
    from edgespec.convert import hf_to_onnx

    if c.smoke:
        return _engine_models(c)["int4"]
    hf = c.work / "draft-0.5b"
    if not (hf / "config.json").is_file():
        save_checkpoint(qwen(c.shapes["0.5b"], "cpu", torch.float16), hf)
    return hf_to_onnx(hf, precision="int4", last_logits_only=True)


def draft(c: Check, data: dict) -> None:
    from edgespec.drafters import ModelDrafter
    from edgespec.lm import TorchLM
    from edgespec.onnx_lm import OnnxLM
    from edgespec.profiling import measure_propose, running_beside, verifying

    c.need(150 if not c.smoke else 5, "draft export")
    start = time.perf_counter()
    onnx_dir = _draft_onnx(c)
    data["export_s"] = round(time.perf_counter() - start, 1)
    target_model = c.models.get("1.5b") or qwen(c.shapes["1.5b"], c.device, c.dtype)
    target = target_for(TorchLM(target_model, name="target"), c.device)
    context = prompt_ids(c.shapes["1.5b"]["vocab_size"], c.context)
    tables = data.setdefault("propose_ms", {})
    for threads in c.draft_threads:
        c.need(20 if not c.smoke else 2, f"draft with {threads} threads")
        lm = OnnxLM(onnx_dir, threads=threads, name="draft")
        drafter = ModelDrafter(lm, name="int4")
        ids = context[: min(len(context), lm.max_context - 16)]
        tables[f"{threads}t-alone"] = measure_propose(drafter, ids, 8, c.repeats)
        with running_beside(verifying(target, context, 5)):
            tables[f"{threads}t-beside-target"] = measure_propose(drafter, ids, 8, c.repeats)
        data["description"] = lm.description
    c.result["draft_tables"] = tables


def ort_cuda(c: Check, data: dict) -> None:
    """Where ONNX Runtime's CUDA provider put each node (its profiler's record), and ms per token."""
    import onnxruntime as ort

    from edgespec.convert import hf_to_onnx
    from edgespec.onnx_lm import OnnxLM, cuda_provider_problem

    if c.cuda and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError(f"no CUDA provider in this onnxruntime {ort.__version__}: {cuda_provider_problem(ort)}")
    c.need(120 if not c.smoke else 5, "fp16 CUDA export")
    if c.smoke:
        onnx_dir = _engine_models(c)["fp16_cuda"]
    else:
        hf = c.work / "draft-0.5b"
        if not (hf / "config.json").is_file():
            save_checkpoint(qwen(c.shapes["0.5b"], "cpu", torch.float16), hf)
        onnx_dir = hf_to_onnx(hf, precision="fp16", execution_provider="cuda", last_logits_only=True)
    prefix = str(c.work / "ort-profile")

    class Profiled(ort.SessionOptions):
        def __init__(self):
            super().__init__()
            self.enable_profiling = True
            self.profile_file_prefix = prefix

    plain = ort.SessionOptions
    ort.SessionOptions = Profiled  # OnnxLM builds its options inside; this run's session profiles itself
    try:
        lm = OnnxLM(onnx_dir, device=c.device, threads=1, name="draft")
    finally:
        ort.SessionOptions = plain
    data["providers"] = lm.session.get_providers()
    ids = prompt_ids(lm.vocab_size, c.context)
    lm.feed(ids, 1)
    for t in ids[:4]:
        lm.feed([t], 1)
    events = json.loads(Path(lm.session.end_profiling()).read_text())
    placed: dict[str, dict[str, int]] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            args = e.get("args", {})
            by_op = placed.setdefault(args.get("provider", "?"), {})
            by_op[args.get("op_name", "?")] = by_op.get(args.get("op_name", "?"), 0) + 1
    data["kernel_runs_by_provider"] = placed
    lm.crop(len(ids))

    def step():
        lm.feed([ids[-1]], 1)
        lm.crop(len(ids))

    data["ms_per_token"] = median_ms(step, max(c.repeats, 10))


def compiled(c: Check, data: dict) -> None:
    try:
        from edgespec.compiled_lm import compiled_lm
    except ImportError:
        raise RuntimeError("edgespec.compiled_lm is absent here (--compile not built): nothing to measure")
    from edgespec.profiling import measure_verify

    for name in ("1.5b", "7b"):
        c.need(120 if not c.smoke else 10, f"compiled {name}")
        model = c.models.get(name) or qwen(c.shapes[name], c.device, c.dtype)  # the eager section's 1.5B
        # A smoke run compiles with Dynamo's "eager" backend: the same tracing, static cache and widths, without
        # inductor's code generation (minutes of C++ on a small CPU).
        # Widths 1..9 only: verify(n) needs no more, and each width is a compile (17 is the default's sixth).
        lm = compiled_lm(model, name="target", report=lambda line: print(f"  {line}", flush=True),
                         widths=COMPILED_WIDTHS, **({"backend": "eager"} if c.smoke else {}))
        context = prompt_ids(c.shapes[name]["vocab_size"], c.context)
        med, spread = measure_verify(target_for(lm, c.device), context, range(1, 10), c.repeats)
        data[name] = {"widths": list(COMPILED_WIDTHS), "backend": lm.settings.backend,
                      "warm_up_s": round(lm.warm_up_s or 0.0, 1), "verify_ms": med, "verify_spread_ms": spread,
                      "graphs_since_warm_up": lm.graphs_since_warm_up()}
        c.result["verify_tables"] = {**c.result.get("verify_tables", {}), f"{name}-compiled": med}
        del model, lm
        if c.cuda:
            torch.cuda.empty_cache()


def cost_model(c: Check, data: dict) -> None:
    from edgespec.costmodel import Latencies, best_k, speedups
    from edgespec.profiling import read_profile

    survival, source = None, None
    for path in sorted(glob.glob(PROFILE_GLOB)):
        prof = read_profile(Path(path))
        if "int4" in prof.data["drafters"]:
            survival = {band: prof.survival("int4", band) for band in ("greedy", "sampling")}
            source = Path(path).name
            break
    if survival is None:
        raise RuntimeError(f"no shipped profile with the int4 drafter matches {PROFILE_GLOB}")
    data["acceptance_from"] = source
    predicted = data.setdefault("predicted", {})
    for target, table in c.result.get("verify_tables", {}).items():
        for draft_name, propose in c.result.get("draft_tables", {}).items():
            lat = Latencies([t / 1000 for t in propose], [t / 1000 for t in table])
            for band, s in survival.items():
                for overlap in (False, True):
                    key = f"{target} / draft {draft_name} / {band} / {'overlap' if overlap else 'sequential'}"
                    k, best = best_k(s, lat, overlap=overlap)
                    predicted[key] = {"by_k": [round(x, 3) for x in speedups(s, lat, overlap=overlap)],
                                      "best_k": k, "best": round(best, 3)}
    if not predicted:
        raise RuntimeError("no verify and draft tables to combine (their sections did not finish)")


# (name, function, seconds it needs left to start, seconds it leaves for the sections after it on a device run)
SECTIONS = [("versions", versions, 5, 0), ("engine", engine, 30, 0), ("rule", rule, 5, 0), ("verify", verify, 60, 0),
            ("compiled", compiled, 60, 170), ("draft", draft, 60, 0), ("ort_cuda", ort_cuda, 30, 0),
            ("cost_model", cost_model, 1, 0)]


# ---------------------------------------------------------------------------------------------- the run


def run_section(c: Check, name: str, fn, minimum_s: float, reserve_s: float = 0.0) -> None:
    """Run one section into its record: ok, failed (its error), stopped or skipped (the time guard). It may use
    the time left but `reserve_s` (kept for the sections after it): past that it is stopped where it is."""
    record = {"status": "skipped", "data": {}}
    c.result["sections"][name] = record
    reserve_s = 0.0 if c.smoke else reserve_s
    if c.left() - reserve_s < minimum_s:
        record["reason"] = f"time guard: {c.left():.0f} s left, {minimum_s + reserve_s:.0f} s needed to start"
        return
    print(f"== {name} ({c.left():.0f} s left)", flush=True)
    start = time.monotonic()
    deadline, c.deadline = c.deadline, c.deadline - reserve_s
    signal.alarm(max(1, int(c.left())))  # a section stuck past its time is stopped where it is
    try:
        fn(c, record["data"])
        record["status"] = "ok"
    except OutOfTime as err:
        record.update(status="stopped", reason=f"time guard: {err}")
    except Exception as err:  # noqa: BLE001 - recorded; the next section runs
        record.update(status="failed", error=f"{type(err).__name__}: {err}"[:1000],
                      traceback=traceback.format_exc().splitlines()[-6:])
    finally:
        signal.alarm(0)
        c.deadline = deadline
        record["seconds"] = round(time.monotonic() - start, 1)
    print(f"   {record['status']} in {record['seconds']} s" + (f": {record.get('error') or record.get('reason')}"
                                                              if record["status"] != "ok" else ""), flush=True)


def _alarm(signum, frame):
    raise OutOfTime("the run's budget ran out inside the section")


def write(c: Check) -> None:
    c.result["wall_s"] = round(time.monotonic() - c.result["_start"], 1)
    public = {k: v for k, v in c.result.items() if not k.startswith("_")}
    (c.out / "gpu-check.json").write_text(json.dumps(public, indent=1, default=str))
    (c.out / "gpu-check.md").write_text(markdown(public))


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = ["# GPU check", "", f"{'smoke run (CPU, tiny shapes)' if s['smoke'] else 'device run'}: device "
             f"{s['device']}, dtype {s['dtype']}, context {s['context']}, repeats {s['repeats']}; wall "
             f"{r['wall_s']} s", "", "| section | status | seconds | note |", "|---|---|---|---|"]
    for name, rec in r["sections"].items():
        note = (rec.get("error") or rec.get("reason") or "").replace("|", "/")[:160]
        lines.append(f"| {name} | {rec['status']} | {rec.get('seconds', '')} | {note} |")
    sections = r["sections"]
    v = sections.get("versions", {}).get("data", {})
    if v:
        lines += ["", f"torch {v.get('torch')} (CUDA {v.get('torch_cuda')}), GPU {v.get('gpu', 'none')} "
                  f"{v.get('capability', '')}, transformers {v.get('transformers')}, onnxruntime {v.get('onnxruntime')} "
                  f"({', '.join(v.get('ort_providers', []))}), builder {v.get('builder')}; ORT CUDA: {v.get('ort_cuda')}"]
    e = sections.get("engine", {}).get("data", {})
    if e.get("runs"):
        lines += ["", "## engine", f"greedy identical to target-only: {e.get('greedy_identical')}; failed runs: "
                  f"{e.get('failures')}; notices: {e.get('notices')}", "",
                  "| drafter | overlap | T | K | tokens | accepted/drafted | tok/s | identical | error |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for run in e["runs"]:
            lines.append(f"| {run['drafter']} | {run.get('overlap', '')} | {run.get('temperature', '')} | "
                         f"{run.get('k', '')} | {run.get('tokens', '')} | {run.get('accepted', '')}/"
                         f"{run.get('drafted', '')} | {run.get('tok_s', '')} | {run.get('identical', '')} | "
                         f"{run.get('error', '')[:80]} |")
    for title, key in (("rule (ms)", "rule"), ("draft propose ms, k = 0..8", "draft"),
                       ("ORT CUDA provider", "ort_cuda")):
        d = sections.get(key, {}).get("data", {})
        if d:
            lines += ["", f"## {title}", "```", json.dumps(d, indent=1, default=str)[:3000], "```"]
    for key in ("verify", "compiled"):
        d = sections.get(key, {}).get("data", {})
        for name, entry in d.items():
            lines += ["", f"## {key} {name}", "verify ms, n = 1..9: " + " ".join(f"{x:.2f}" for x in
                                                                               entry["verify_ms"][1:])]
            for label, t in entry.get("timings", {}).items():
                lines.append(f"- timings {label}: {json.dumps(t)}")
            if "memory" in entry:
                lines.append(f"- memory: {json.dumps(entry['memory'])}")
            if "warm_up_s" in entry:
                lines.append(f"- warm-up {entry['warm_up_s']} s, graphs compiled after it: "
                             f"{entry['graphs_since_warm_up']}")
    cm = sections.get("cost_model", {}).get("data", {})
    if cm.get("predicted"):
        lines += ["", f"## predicted speed-up per K (acceptance: {cm.get('acceptance_from')})"]
        for key, p in cm["predicted"].items():
            lines.append(f"- {key}: best K={p['best_k']} ({p['best']:.2f}x); by K: "
                         + " ".join(f"{x:.2f}" for x in p["by_k"]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"))
    ap.add_argument("--smoke", action="store_true", help="every section on the CPU with tiny shapes")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting work after this (default 450; "
                    "smoke 600)")
    ap.add_argument("--sections", default=None, help="comma list of sections to run, in that order (default: all)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("EDGESPEC_CACHE", tempfile.mkdtemp(prefix="edgespec-gpu-check-"))
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; --smoke runs every section on the CPU", file=sys.stderr)
        return 2
    budget = args.budget_s or (600.0 if args.smoke else 450.0)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        c = Check(out=out, smoke=args.smoke, device="cpu" if args.smoke else "cuda",
                  dtype=torch.float32 if args.smoke else torch.bfloat16, shapes=TINY if args.smoke else QWEN,
                  context=32 if args.smoke else 512, repeats=3 if args.smoke else 20,
                  new_tokens=16 if args.smoke else 48,
                  draft_threads=[1] if args.smoke else sorted({4, max(1, cores - 1)}),
                  deadline=time.monotonic() + budget, work=Path(work))
        c.result = {"_start": time.monotonic(), "settings": {"smoke": c.smoke, "device": c.device,
                    "dtype": str(c.dtype).removeprefix("torch."), "context": c.context, "repeats": c.repeats,
                    "budget_s": budget, "draft_threads": c.draft_threads}, "sections": {}}
        signal.signal(signal.SIGALRM, _alarm)
        known = {name: (fn, minimum, reserve) for name, fn, minimum, reserve in SECTIONS}
        order = args.sections.split(",") if args.sections else list(known)
        unknown = [name for name in order if name not in known]
        if unknown:
            print(f"gpu_check: unknown section(s) {', '.join(unknown)}; choose from {', '.join(known)}",
                  file=sys.stderr)
            return 2
        for name in order:
            run_section(c, name, *known[name])
            write(c)
    print(f"wrote {out / 'gpu-check.json'} and {out / 'gpu-check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
