"""From what the user asked for (a pair, or paths; backends; devices) to a ready engine and tokenizer.

This is where placement is decided: the target runs FP16 under PyTorch on CUDA when a GPU is here, and
otherwise on the CPU under ONNX Runtime (faster than torch on CPUs: INT4 MatMulNBits kernels); the model
drafter runs INT4 under ONNX Runtime on the CPU. It resolves and converts models through `edgespec.models`
and `edgespec.convert` (cached, so only the first start is slow) and validates the pair before anything
runs. A GGUF's weights are converted only when a torch or ONNX model is made from them (`_Source.weights`):
llama.cpp runs the file as it is, with its tokenizer and config read into a folder without weights. It does
not generate: see `edgespec.engine` and `edgespec.session`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EdgespecError

DEFAULT_PAIR = "smollm2-135m"
TARGET_BACKENDS = ("auto", "torch", "onnx", "llamacpp")
DRAFTERS = ("int4", "int8", "torch", "llamacpp", "ngram", "none")
MODEL_DRAFT_BACKENDS = ("int4", "int8", "torch", "llamacpp")  # how a draft model runs


@dataclass
class RuntimeSpec:
    pair: str | None = None  # manifest name or path; default DEFAULT_PAIR unless `target` is given
    target: str | None = None  # a checkpoint dir, .gguf file or ONNX dir instead of the pair's target
    draft: str | None = None  # a drafter name (int4, torch, ngram, none) or a draft checkpoint path
    draft_backend: str = "int4"  # how a draft given as a path runs: int4 / int8 (ONNX Runtime) or torch
    target_backend: str = "auto"
    target_device: str = "auto"
    draft_device: str = "cpu"
    dtype: str = "auto"
    threads: int | None = None  # ONNX Runtime intra-op threads per session (default: all cores)
    draft_threads: int | None = None  # the draft session's threads (default: `threads`)
    # Draft round i+1 on its own thread while the target verifies round i. None: as this machine's profile
    # chose for --k auto (`select_profile`), off otherwise. On, with no threads given, the cores are split
    # (`edgespec.hardware.overlap_split`).
    overlap: bool | None = None
    exact: bool = False  # the target's short steps run padded to the rows that make it exact (`lm.exact_rows`): greedy output bitwise the same at every K
    compile: bool | None = None  # a torch target's steps under torch.compile (`edgespec.compiled_lm`); None: `compiles` decides

    @classmethod
    def from_args(cls, args) -> RuntimeSpec:
        """From the CLI's shared model options (`edgespec.cli.add_model_options`)."""
        return cls(pair=args.pair, target=args.target, draft=args.draft, draft_backend=args.draft_backend,
                   target_backend=args.target_backend, target_device=args.target_device,
                   draft_device=args.draft_device, dtype=args.dtype, threads=args.threads,
                   draft_threads=getattr(args, "draft_threads", None), overlap=getattr(args, "overlap", None),
                   exact=getattr(args, "exact", False), compile=getattr(args, "compile", None))


@dataclass
class Runtime:
    engine: object
    tokenizer: object
    target_description: str
    draft_description: str | None
    pair: str | None
    drafter_name: str
    target_source: _Source | None = None  # where the models came from (a GGUF's weights converted on demand)
    draft_source: _Source | None = None
    target_backend: str = "onnx"
    pair_self_draft: bool = False  # the pair drafts with its own target model (quantised)
    spec: RuntimeSpec | None = None  # what it was built from (extra drafters are placed the same way)
    notes: list[str] = field(default_factory=list)

    @property
    def target_gguf(self) -> Path | None:
        """The target's GGUF file, when it came as one (llama.cpp runs it as it is)."""
        return self.target_source.gguf if self.target_source else None

    @property
    def draft_gguf(self) -> Path | None:
        return self.draft_source.gguf if self.draft_source else None

    def target_weights(self) -> Path | None:
        """The transformers checkpoint with the target's weights (a GGUF's converted now if it was not yet);
        None for an ONNX target."""
        return self.target_source.weights() if self.target_source else None

    def draft_weights(self) -> Path | None:
        """The draft model's checkpoint with weights, as `target_weights`; None without a draft model."""
        return self.draft_source.weights() if self.draft_source else None


def planned_backend(spec: RuntimeSpec) -> str:
    """The target backend `build_runtime` will use for `spec`: torch on CUDA; on the CPU a GGUF target runs on
    llama.cpp's own kernels when the backend is installed (the fastest there are for the format: 2.65x the ONNX
    fp32 target on the embedded default, docs/bench/llamacpp/), anything else on ONNX Runtime."""
    from . import llamacpp_lm
    from .hardware import check_device

    if spec.target_backend != "auto":
        return spec.target_backend
    if check_device(spec.target_device, flag="--target-device").startswith("cuda"):
        return "torch"
    return "llamacpp" if target_is_gguf(spec) and llamacpp_lm.available() else "onnx"


def planned_target_device(spec: RuntimeSpec) -> str:
    """The device the target will run on ("cpu", "cuda", "cuda:N"), see `resolve_device`."""
    return resolve_device(planned_backend(spec), spec.target_device, "--target-device")


def resolve_device(backend: str, name: str, flag: str) -> str:
    """The device a model on `backend` runs on for the `--target-device`/`--draft-device` value `name`: a llama.cpp
    model where llama.cpp's own build can run it, whatever torch was built for (`llamacpp_lm.check_device`);
    any other as torch sees the machine (`hardware.check_device`)."""
    if backend == "llamacpp":
        from . import llamacpp_lm

        return llamacpp_lm.check_device(name, flag=flag)
    from .hardware import check_device

    return check_device(name, flag=flag)


def target_is_gguf(spec: RuntimeSpec) -> bool:
    """Whether the target `spec` names comes as a GGUF file (a pair's manifest says so, or the path ends .gguf)."""
    from .models import load_manifest

    if spec.target is not None:
        return str(spec.target).lower().endswith(".gguf")
    return load_manifest(spec.pair or DEFAULT_PAIR).target.format == "gguf"


def planned_torch_detail(spec: RuntimeSpec) -> str | None:
    """How a torch target will run ("torch cpu bfloat16"), the way its description will end; None for ONNX."""
    import torch

    from .hardware import check_device
    from .lm import torch_description
    from .loading import pick_dtype

    if planned_backend(spec) != "torch":
        return None
    device = torch.device(check_device(spec.target_device, flag="--target-device"))
    return torch_description(device, pick_dtype(spec.dtype, device)) + (" compiled" if compiles(spec) else "")


def compiles(spec: RuntimeSpec) -> bool:
    """Whether the target runs compiled (`edgespec.compiled_lm`): as --compile says on a torch target; not given,
    on CUDA as `COMPILE_ON_CUDA_DEFAULT` says and never on the CPU. --compile on another backend is an error."""
    from .compiled_lm import COMPILE_ON_CUDA_DEFAULT
    from .hardware import check_device

    backend = planned_backend(spec)
    if spec.compile and backend != "torch":
        raise EdgespecError(f"--compile compiles a torch target and this target runs on {backend}; "
                            "add --target-backend torch or drop --compile")
    if spec.compile is not None:
        return spec.compile
    return (COMPILE_ON_CUDA_DEFAULT and backend == "torch"
            and check_device(spec.target_device, flag="--target-device").startswith("cuda"))


def build_runtime(spec: RuntimeSpec, progress: Callable[[str], None] | None = None) -> Runtime:
    """Resolve, convert (first run only), validate and load; progress lines go to `progress` (default stderr)."""
    from .progress import report, reporting_to

    if progress is None:
        return _build_runtime(spec, report)
    with reporting_to(progress):
        return _build_runtime(spec, progress)


def _build_runtime(spec: RuntimeSpec, progress: Callable[[str], None]) -> Runtime:
    from .drafters import ModelDrafter, NgramDrafter
    from .engine import SpeculativeEngine
    from .loading import load_tokenizer
    from .models import load_manifest

    if spec.target_backend not in TARGET_BACKENDS:
        raise EdgespecError(f"unknown target backend {spec.target_backend!r}; use one of {', '.join(TARGET_BACKENDS)}")
    manifest = None
    if spec.target is None:
        manifest = load_manifest(spec.pair or DEFAULT_PAIR)
    elif spec.pair is not None:
        raise EdgespecError("give either --pair or --target, not both")
    backend = planned_backend(spec)
    target_device = resolve_device(backend, spec.target_device, "--target-device")

    compiles(spec)  # --compile on a backend that cannot: the error before anything loads
    drafter_name = spec.draft or (manifest.default_drafters[0] if manifest else "ngram")
    draft_path = None
    if drafter_name not in DRAFTERS:
        if spec.draft_backend not in MODEL_DRAFT_BACKENDS:
            raise EdgespecError(f"unknown draft backend {spec.draft_backend!r}; use {', '.join(MODEL_DRAFT_BACKENDS)}")
        draft_path, drafter_name = drafter_name, spec.draft_backend
    draft_device = resolve_device(_lm_backend(drafter_name), spec.draft_device, "--draft-device")
    # The pair's own model drafts for it: one source, its weights converted once if the drafter needs them.
    self_draft = manifest is not None and manifest.draft is None and draft_path is None
    # ---- target
    # A GGUF's weights are converted only for a torch or ONNX model: the target's, or the drafter's of the same file.
    target_weights = backend != "llamacpp" or (self_draft and _needs_weights(drafter_name))
    if manifest is not None:
        progress(f"target: {manifest.target.upstream or manifest.name}")
        target_source = _model_dir(manifest.target, progress, weights=target_weights)
        onnx_precision = manifest.target.onnx_precision
    else:
        target_source = _local_model(spec.target, progress, weights=target_weights)
        onnx_precision = "fp32"
    target_label = _label(manifest.target if manifest else None, spec.target)
    if spec.overlap and spec.threads is None and spec.draft_threads is None and drafter_name != "ngram":
        split_cores(spec, target_device, progress)
    tokenizer = load_tokenizer(target_source.tokenizer_dir)
    target_lm = _build_lm(target_source, backend, target_device, spec, onnx_precision, "target", progress)
    if spec.exact:
        from .lm import EXACT_ROW_COUNTS, exact_rows

        progress("target: finding the row count that makes its steps exact")
        if exact_rows(target_lm) is None:
            raise EdgespecError(f"--exact: this target ({target_lm.description}) rounds a row differently with "
                                f"every step size tried ({', '.join(map(str, EXACT_ROW_COUNTS))} rows at least), "
                                f"so no padding makes its output the same at every K; drop --exact")

    # ---- drafter
    drafter = None
    draft_description = None
    draft_source = None
    if drafter_name == "ngram":
        drafter = NgramDrafter()
        draft_description = drafter.description
    elif drafter_name in MODEL_DRAFT_BACKENDS:
        draft_weights = _needs_weights(drafter_name)
        if draft_path is not None:
            draft_source = _local_model(draft_path, progress, weights=draft_weights)
        elif manifest is not None:
            progress(f"draft: {manifest.draft_model.upstream or manifest.name}")
            draft_source = target_source if self_draft else _model_dir(manifest.draft_model, progress,
                                                                       weights=draft_weights)
        else:
            raise EdgespecError(f"--draft {drafter_name} needs a pair (--pair) or a draft path (--draft DIR)")
        if draft_source.info_dir is not None and not draft_source.same_model(target_source):
            validate_pair(target_source.tokenizer_dir, draft_source.info_dir, tokenizer)
        draft_lm = _build_lm(draft_source, _lm_backend(drafter_name), draft_device, spec, drafter_name, "draft",
                             progress)
        drafter = ModelDrafter(draft_lm, name=drafter_name)
        draft_label = _label(manifest.draft_model if manifest and draft_path is None else None, draft_path)
        draft_description = f"{draft_label} · {draft_lm.description}"

    eos = _eos_ids(target_source, tokenizer)
    torch_threads(backend == "torch" or _lm_backend(drafter_name) == "torch")  # after every conversion
    progress("ready")
    engine = SpeculativeEngine(_target(target_lm, target_device if backend == "torch" else "cpu"), drafter,
                               eos_token_ids=eos, overlap=bool(spec.overlap))
    return Runtime(engine, tokenizer, f"{target_label} · {target_lm.description}", draft_description,
                   manifest.name if manifest else None, drafter_name, target_source=target_source,
                   draft_source=draft_source, target_backend=backend,
                   pair_self_draft=manifest is not None and manifest.draft is None, spec=spec)


def overlap_threads(target_device: str) -> tuple[int | None, int] | None:
    """(target, draft) threads of the default overlap split for a target on `target_device` (a resolved
    device: `hardware.check_device`), over the cores this process may use; None with one core."""
    from .hardware import overlap_split
    from .onnx_lm import default_threads

    return overlap_split(default_threads(), target_on_gpu=target_device.startswith("cuda"))


def split_cores(spec: RuntimeSpec, target_device: str, progress: Callable[[str], None]) -> None:
    """Overlap on and no threads given: the draft and the target get cores of their own (the default split of
    `edgespec devices`), instead of two thread pools each as wide as the machine taking turns on every core."""
    split = overlap_threads(target_device)
    if split is not None:
        spec.threads, spec.draft_threads = split
        target = "the GPU" if split[0] is None else f"{split[0]} thread(s)"
        progress(f"overlap: target {target}, draft {split[1]} thread(s) (set others with --threads/--draft-threads)")


def extra_drafter(rt: Runtime, name: str):
    """Another drafter over the same models as `rt` (bench and profile compare several): the one `rt` already
    has, n-gram, or the draft model under another backend, placed as `rt`'s spec says. None when `rt` has no
    draft model to build it from."""
    from . import llamacpp_lm
    from .drafters import ModelDrafter, NgramDrafter
    from .progress import report

    if name == rt.drafter_name and rt.engine.drafter is not None:
        return rt.engine.drafter
    if name == "ngram":
        return NgramDrafter()
    source = rt.draft_source or (rt.target_source if rt.pair_self_draft else None)
    if source is None or (source.hf_dir is None and source.gguf is None):  # none, or an ONNX model: one precision
        return None
    if name == "llamacpp" and (source.gguf is None or not llamacpp_lm.available()):
        return None
    spec = rt.spec or RuntimeSpec()
    # a GGUF's weights are converted here if this drafter needs them and nothing converted them yet
    backend = _lm_backend(name)
    lm = _build_lm(source, backend, resolve_device(backend, spec.draft_device, "--draft-device"), spec, name, "draft",
                   report)
    return ModelDrafter(lm, name=name)


def _needs_weights(drafter_name: str) -> bool:
    """Whether this drafter runs a model made from the draft's weights (torch, or an ONNX export): a GGUF draft
    is then converted; n-gram needs no model and llama.cpp runs the GGUF as it is."""
    return drafter_name in MODEL_DRAFT_BACKENDS and _lm_backend(drafter_name) != "llamacpp"


def _lm_backend(drafter_name: str) -> str:
    """The CausalLM backend a model drafter runs on: int4/int8 are ONNX Runtime precisions."""
    return drafter_name if drafter_name in ("torch", "llamacpp") else "onnx"


def validate_pair(target_dir: Path, draft_dir: Path, target_tokenizer) -> None:
    """Before anything runs: both decoder-only, one tokenizer (the same tokens, ids and special tokens), the same
    EOS/BOS, and a draft embedding no larger than the target's (a smaller one is fine: `verify.common_width`)."""
    from .loading import check_decoder_only, check_same_tokenizer, load_config, load_tokenizer

    t_cfg, d_cfg = load_config(target_dir), load_config(draft_dir)
    check_decoder_only(t_cfg, target_dir)
    check_decoder_only(d_cfg, draft_dir)
    draft_tokenizer = load_tokenizer(draft_dir)
    check_same_tokenizer(target_tokenizer, draft_tokenizer)
    for name in ("eos_token_id", "bos_token_id"):
        t, d = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if t != d:
            raise EdgespecError(f"draft and target disagree on {name} ({d} vs {t}); use a draft model from the target's family")
    from .engine import check_vocab_sizes

    # Checked on the configs, before the draft's weights are loaded (the engine checks the loaded models too).
    check_vocab_sizes(getattr(d_cfg.get_text_config(), "vocab_size", None),
                      getattr(t_cfg.get_text_config(), "vocab_size", None))


@dataclass
class _Source:
    """Where one model comes from: a transformers checkpoint, a ready ONNX model, or a GGUF file.

    llama.cpp runs a GGUF as it is; its weights are dequantised into a checkpoint (`convert.gguf_to_hf`) only
    when a torch or ONNX model is made from them, by `weights()`. Until then `meta_dir` holds the GGUF's
    tokenizer, config and generation config without weights (`convert.gguf_meta`)."""

    hf_dir: Path | None = None  # a checkpoint with weights (torch; source of ONNX exports); a GGUF's once converted
    onnx_dir: Path | None = None  # a ready ONNX model (ORT backend only)
    gguf: Path | None = None  # the GGUF file itself (the llama.cpp backend runs it as it is)
    gguf_sha256: str | None = None  # its digest where a manifest pins it (spares hashing the file)
    meta_dir: Path | None = None  # a GGUF's tokenizer, config and generation config, no weights

    @property
    def info_dir(self) -> Path | None:
        """Tokenizer, config and generation config in transformers' layout: the checkpoint, else a GGUF's metadata."""
        return self.hf_dir or self.meta_dir

    @property
    def tokenizer_dir(self) -> Path | None:
        """Where the tokenizer is read from (an ONNX model's folder holds one too)."""
        return self.info_dir or self.onnx_dir

    def weights(self) -> Path | None:
        """The checkpoint with weights: a GGUF's is converted on the first call (cached on disk); None for ONNX."""
        if self.hf_dir is None and self.gguf is not None:
            from .convert import gguf_to_hf

            self.hf_dir = gguf_to_hf(self.gguf, sha256=self.gguf_sha256)
        return self.hf_dir

    def same_model(self, other: _Source) -> bool:
        """Whether both name one model (the same GGUF file, or the same checkpoint): no pair check needed."""
        return self is other or (self.gguf is not None and self.gguf == other.gguf) or \
            (self.info_dir is not None and self.info_dir == other.info_dir)


def _gguf_source(path: Path, sha256: str | None, weights: bool) -> _Source:
    """A GGUF's source: its weights converted now when `weights`, else its metadata only (`convert.gguf_meta`)."""
    source = _Source(gguf=path, gguf_sha256=sha256)
    if weights:
        source.weights()
    else:
        _metadata(source)
    return source


def _model_dir(model, progress, *, weights: bool = True) -> _Source:
    """A pair's model, resolved (downloaded once); a GGUF's weights converted only when `weights` (`_gguf_source`)."""
    from .models import resolve_model

    path = resolve_model(model)
    if model.format == "gguf":
        return _gguf_source(path, model.source.sha256, weights)
    if model.format == "onnx":
        return _Source(onnx_dir=path if path.is_dir() else path.parent)
    return _Source(hf_dir=path)


def _local_model(path: str, progress, *, weights: bool = True) -> _Source:
    """A model the user named: a checkpoint dir, a .gguf file, an ONNX dir, or a Hugging Face hub id
    (`org/name`, `org/name/file.gguf`; from the hub's cache when it is there, see `models.resolve_hub_id`); a
    GGUF's weights converted only when `weights`."""
    from .loading import checkpoint_dir
    from .models import is_hub_id, resolve_hub_id
    from .paths import user_path

    p = resolve_hub_id(path) if is_hub_id(str(path)) else user_path(path, "model path")
    if p.is_file() and p.suffix == ".gguf":
        return _gguf_source(p, None, weights)
    if p.is_dir() and (p / "genai_config.json").is_file():
        return _Source(onnx_dir=p)
    return _Source(hf_dir=checkpoint_dir(p))


_MEMORY_FIX = {  # what to do when a model does not fit where it is about to load (`edgespec.budget`)
    "target": "use a smaller model (--pair, --target), --dtype bfloat16 or float16 rather than float32, or "
              "--target-device cpu",
    "draft": "use a smaller draft model, --draft-device cpu, or --draft ngram",
}


_TORCH_THREADS: int | None = None  # torch's own intra-op thread count while edgespec keeps it at 1


def torch_threads(models_in_torch: bool) -> None:
    """torch at one intra-op thread while no model of the process runs in torch (only the rule's small ops do),
    torch's own count back when one does. llama.cpp's kernels and torch share one GNU OpenMP runtime, which stops
    spinning at its barriers once the live OpenMP teams hold more threads than there are cores: torch's team in
    a caller's thread beside llama.cpp's on its runner thread made every step 35-45% slower on 2 cores
    (docs/serve.md, "Threads")."""
    global _TORCH_THREADS
    import torch

    if models_in_torch:
        if _TORCH_THREADS is not None:
            torch.set_num_threads(_TORCH_THREADS)
            _TORCH_THREADS = None
    elif _TORCH_THREADS is None:
        _TORCH_THREADS = torch.get_num_threads()
        torch.set_num_threads(1)


def _build_lm(source: _Source, backend: str, device: str, spec: RuntimeSpec, onnx_precision: str, role: str, progress):
    from .budget import check_before_loading, onnx_need, torch_need_for

    if backend == "torch":
        torch_threads(True)
    if backend == "llamacpp":
        from .llamacpp_lm import LlamaCppLM

        if source.gguf is None:
            raise EdgespecError(f"the llama.cpp backend runs GGUF files and this {role} is not one; "
                                "use --target-backend onnx or torch")
        threads = spec.draft_threads or spec.threads if role == "draft" else spec.threads
        # an overlapped drafter steps beside the target, so not on the target's llama.cpp thread
        runner = "llama.cpp draft" if role == "draft" and spec.overlap else "llama.cpp"
        return LlamaCppLM(source.gguf, threads=threads, device=device, name=role, runner_name=runner)
    if backend == "torch":
        from .lm import TorchLM
        from .loading import load_causal_lm

        hf_dir = source.weights()
        if hf_dir is None:
            raise EdgespecError(f"the {role} is an ONNX model, which only runs with --target-backend onnx")
        check_before_loading(device, lambda: torch_need_for(role, hf_dir, device, spec.dtype),
                             _MEMORY_FIX[role])
        model = load_causal_lm(hf_dir, device=device, dtype=spec.dtype,
                               device_flag="--target-device" if role == "target" else "--draft-device")
        if role == "target" and compiles(spec):
            from .compiled_lm import compiled_lm

            return compiled_lm(model, name=role, report=progress)
        return TorchLM(model, name=role)
    from .convert import hf_to_onnx
    from .onnx_lm import OnnxLM

    onnx_dir = source.onnx_dir
    if onnx_dir is None:
        # A drafter needs the last position's logits only: its prefill then skips the vocabulary-sized matmul.
        onnx_dir = hf_to_onnx(source.weights(), **onnx_export(onnx_precision, device), last_logits_only=role == "draft")
    threads = spec.draft_threads or spec.threads if role == "draft" else spec.threads
    check_before_loading(device, lambda: onnx_need(f"the {role}", onnx_dir), _MEMORY_FIX[role])
    return OnnxLM(onnx_dir, threads=threads, device=device, name=role)


def onnx_export(precision: str, device: str) -> dict:
    """`hf_to_onnx`'s precision and execution provider for a model that will run on `device`: on CUDA a graph
    built for the CUDA provider (float16 attention; an fp32 export becomes fp16, which that provider runs)."""
    if not device.startswith("cuda"):
        return {"precision": precision}
    return {"precision": "fp16" if precision == "fp32" else precision, "execution_provider": "cuda"}


def _label(model, path: str | None) -> str:
    """A short model name for status lines: the upstream repo's last part, or the path's name."""
    if model is not None and model.upstream:
        return model.upstream.rsplit("/", 1)[-1]
    return Path(path).name if path else "model"


def _target(lm, device: str = "cpu"):
    """The engine's target over `lm`, waiting for `device` before the engine reads its clock (a torch model on
    CUDA; ONNX Runtime's `run` returns when its outputs are ready)."""
    from .target import ModelTarget, synchronizer

    return ModelTarget(lm, synchronize=synchronizer(device))


def _eos_ids(source: _Source, tokenizer) -> list[int]:
    """EOS ids from the generation config (it may list several, e.g. <|im_end|> and <|endoftext|>) and tokenizer."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    for d in (source.info_dir, source.onnx_dir):
        if d is not None and (Path(d) / "generation_config.json").is_file():
            eos = GenerationConfig.from_pretrained(d).eos_token_id
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def select_profile(spec: RuntimeSpec, profile_path: str | None, temperature: float, *, choose_drafter: bool = True):
    """For K = auto: the profile to use (`profile_path`, else the one measured on this machine for this pair
    and target backend) and, when `choose_drafter` and the user named no drafter, the drafter it recommends
    (written into `spec.draft`). A bad profile is a one-line warning, and K is then calibrated online."""
    from . import profiling
    from .models import load_manifest
    from .progress import report

    def warn(msg):
        report(f"warning: {msg}")

    profile = None
    if profile_path:
        try:
            profile = profiling.read_profile(profile_path)
        except EdgespecError as err:
            warn(f"{err}; calibrating K online instead")
    else:
        profile = matching_profile(spec, warn=warn)
    if profile is None:
        if not profile_path:
            warn(f"no profile for this machine and pair; K is calibrated during the first rounds ({profile_hint(spec)})")
    elif choose_drafter:
        choice = profile.choice(profiling.band_for(temperature))
        if spec.draft is None and choice["drafter"] != "none":
            spec.draft = choice["drafter"]
        elif spec.draft is None and (spec.target is not None or "ngram" in load_manifest(
                spec.pair or DEFAULT_PAIR).default_drafters):
            # No drafter pays here. The pair's first drafter, a model, would be loaded only to be probed now and
            # then: SmolLM2's INT8 draft cost 3-5% that way on an AVX-512 EPYC (56 prompts, a draft share of 3%).
            # The n-gram lookup costs nothing to keep beside the target, and its proposals, checked in the
            # shadow, bring drafting back where the text starts to repeat itself.
            spec.draft = "ngram"
        if spec.overlap is None and choice.get("overlap") and spec.draft == choice["drafter"]:
            # Measured to win here: on (with the profile's split of the cores unless threads were given).
            spec.overlap = True
            if spec.threads is None and spec.draft_threads is None:
                spec.threads, spec.draft_threads = choice.get("threads"), choice.get("draft_threads")
            report(f"overlap on: this machine's profile predicts {choice['request_speedup']:.2f}x with the "
                   f"draft beside the target against {choice.get('sequential_speedup', 1.0):.2f}x one after "
                   f"the other (--no-overlap turns it off)")
    if spec.overlap is None:
        spec.overlap = False
    return profile


# How long `edgespec profile` took, measured on 2 Xeon cores with AMX (docs/bench/amx/p-min/README.md, item 4:
# SmolLM2 17:17-17:20, Qwen 17:21-17:28): minutes, for the one line that says what running it costs.
PROFILE_MINUTES = {"smollm2-135m": 3, "qwen2.5-coder-1.5b": 7}


def profile_hint(spec: RuntimeSpec) -> str:
    """The command that measures this machine for `spec`'s pair, and how long it takes where that was measured."""
    pair = spec.pair or (DEFAULT_PAIR if spec.target is None else None)
    if pair is None:
        return ("`edgespec profile` with the same --target/--draft measures this machine once (several minutes) "
                "and writes a profile to pass with --profile PATH")
    took = (f"about {PROFILE_MINUTES[pair]} minutes on 2 Xeon cores" if pair in PROFILE_MINUTES
            else "several minutes")
    return f"`edgespec profile --pair {pair}` measures this machine once and skips this from then on: {took}"


def matching_profile(spec: RuntimeSpec, *, warn=lambda _msg: None):
    """The profile measured on this machine for this pair and target backend (None for a custom --target);
    a bad one goes to `warn`, silently by default (for callers that only report with it)."""
    from . import profiling
    from .hardware import describe

    if spec.target is not None:
        return None
    return profiling.find_profile(spec.pair or DEFAULT_PAIR, planned_backend(spec), describe().to_dict(),
                                  target_detail=planned_torch_detail(spec), warn=warn)


def make_policy(k, profile, drafter_name: str, temperature: float, *, overlap: bool = False,
                p_min: float | None = None):
    """FixedK for a number; for "auto", the adaptive policy seeded from the profile (or calibrating), using
    the cost model's overlapped form when drafting overlaps verification. `p_min` (None: 0 for a fixed K,
    DEFAULT_P_MIN for auto): a model draft stops after a token its model gave less than that probability."""
    from .policy import FixedK
    from .profiling import policy_from_profile

    if k != "auto":
        return FixedK(k, p_min=p_min or 0.0)
    return policy_from_profile(profile, drafter_name, temperature, overlap=overlap, p_min=p_min)


def build_session(args, progress: Callable[[str], None] | None = None):
    """A `ChatSession` for `edgespec chat`: the runtime from the CLI's model options, and K from the
    per-turn settings (`auto` = one adaptive policy kept across turns, so what it learnt about this machine's
    latencies carries over from one answer to the next)."""
    from .policy import FixedK, check_k, parse_p_min
    from .progress import reporting_to
    from .session import ChatSession

    spec = RuntimeSpec.from_args(args)
    p_min = parse_p_min(getattr(args, "p_min", None))
    temperature = getattr(args, "temperature", 0.0) or 0.0
    with reporting_to(progress) if progress else contextlib.nullcontext():
        profile = select_profile(spec, getattr(args, "profile", None), temperature)
    rt = build_runtime(spec, progress)
    policies = {}  # one adaptive policy per temperature band, kept across turns: it keeps what it learnt

    def policy_for(settings):
        if settings.k != "auto":
            return FixedK(check_k(int(settings.k)), p_min=p_min or 0.0)
        band = "greedy" if settings.temperature == 0 else "sampling"
        if band not in policies:
            policies[band] = make_policy("auto", profile, rt.drafter_name, settings.temperature, overlap=bool(spec.overlap),
                                         p_min=p_min)
        return policies[band]

    return ChatSession(rt.engine, rt.tokenizer, target_description=rt.target_description,
                       draft_description=rt.draft_description, policy_factory=policy_for)


PREPARE_BACKENDS = ("auto", "llamacpp", "onnx", "torch", "all")


def prepare_for(backend: str, spec: RuntimeSpec) -> set[str]:
    """The target backends `edgespec prepare --target-backend BACKEND` converts for: "auto" is the one a start on
    this machine will use (`planned_backend`), "all" every one (for a cache made here and used elsewhere)."""
    if backend not in PREPARE_BACKENDS:
        raise EdgespecError(f"--target-backend {backend!r}: use one of {', '.join(PREPARE_BACKENDS)}")
    if backend == "all":
        return {"llamacpp", "onnx", "torch"}
    return {planned_backend(spec) if backend == "auto" else backend}


def prepare_models(target: str, draft: str | None = None, *, drafters: tuple[str, ...] | None = None,
                   backend: str = "auto", progress: Callable[[str], None] | None = None) -> dict[str, Path]:
    """`edgespec prepare --target X [--draft Y]`: fetch (a hub id downloads once into the hub's cache), convert and
    check the models a later `--target X --draft Y` runs (the target for `backend`, see `prepare_for`: ONNX fp32,
    transformers weights, or a GGUF's tokenizer and config for llama.cpp; the draft as the ONNX `drafters`,
    default int4; the pair's tokenizers compared), so that start reaches its first token in seconds. Returns what
    was prepared."""
    from .convert import hf_to_onnx
    from .loading import load_tokenizer
    from .progress import report, reporting_to

    with reporting_to(progress) if progress else contextlib.nullcontext():
        out: dict[str, Path] = {}
        backends = prepare_for(backend, RuntimeSpec(target=target))
        report(f"target: {target} (for {_backend_names(backends)})")
        t = _local_model(target, report, weights=bool(backends - {"llamacpp"}))
        if t.gguf is not None:
            out["target (gguf)"] = t.gguf
        _prepare_target(t, backends, "fp32", out)
        if draft is None:
            return out
        report(f"draft: {draft}")
        d = _local_model(draft, report)
        if d.hf_dir is None:
            raise EdgespecError(f"the draft {draft} is an ONNX model; give its transformers checkpoint or GGUF, "
                                "which edgespec converts for each drafter")
        validate_pair(t.tokenizer_dir, d.hf_dir, load_tokenizer(t.tokenizer_dir))
        out["draft (transformers)"] = d.hf_dir
        for name in drafters or ("int4",):
            if name not in ("int4", "int8"):
                raise EdgespecError(f"--drafters {name}: prepare converts ONNX drafters (int4, int8); "
                                    "torch and llamacpp drafters run the checkpoint or GGUF as it is")
            out[f"draft (onnx {name})"] = hf_to_onnx(d.hf_dir, precision=name, last_logits_only=True)
        return out


def prepare_pair(pair: str, *, drafters: tuple[str, ...] | None = None, backend: str = "auto",
                 progress: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Download, verify and convert what `pair` needs for `backend` (`prepare_for`: by default the target backend
    a start on this machine uses; "all": a GGUF target's weights for torch and ONNX and its tokenizer and config
    for llama.cpp) and for its drafters, so a later start reaches the first token in seconds. Returns what was
    prepared."""
    from .convert import hf_to_onnx
    from .models import load_manifest
    from .progress import report, reporting_to

    with reporting_to(progress) if progress else contextlib.nullcontext():
        say = report
        manifest = load_manifest(pair)
        out: dict[str, Path] = {}
        backends = prepare_for(backend, RuntimeSpec(pair=pair))
        say(f"target: {manifest.target.upstream or manifest.name} (for {_backend_names(backends)})")
        target = _model_dir(manifest.target, say, weights=bool(backends - {"llamacpp"}))
        _prepare_target(target, backends, manifest.target.onnx_precision, out)
        model_drafters = [d for d in (drafters or manifest.default_drafters) if d in MODEL_DRAFT_BACKENDS]
        if model_drafters:
            say(f"draft: {manifest.draft_model.upstream or manifest.name}")
            # the llama.cpp drafter runs the GGUF as it is (its tokenizer and config checked against the target's)
            draft = _model_dir(manifest.draft_model, say, weights=any(map(_needs_weights, model_drafters)))
            if draft.gguf is not None and "llamacpp" in model_drafters:
                out["draft (metadata)"] = _metadata(draft)
            if draft.hf_dir is not None:
                out["draft (transformers)"] = draft.hf_dir
                for d in model_drafters:
                    if d in ("int4", "int8"):
                        out[f"draft (onnx {d})"] = hf_to_onnx(draft.hf_dir, precision=d, last_logits_only=True)
        return out


def _prepare_target(source: _Source, backends: set[str], onnx_precision: str, out: dict[str, Path]) -> None:
    """`prepare`'s target: a GGUF's tokenizer and config, its (or a checkpoint's) transformers weights when a
    backend but llama.cpp needs them (`source` was resolved with them), the ONNX export for ONNX Runtime."""
    from .convert import hf_to_onnx

    if source.gguf is not None:
        out["target (metadata)"] = _metadata(source)
    if source.hf_dir is not None:
        out["target (transformers)"] = source.hf_dir
        if "onnx" in backends:
            out[f"target (onnx {onnx_precision})"] = hf_to_onnx(source.hf_dir, precision=onnx_precision)
    elif source.onnx_dir is not None:
        out["target (onnx)"] = source.onnx_dir


def _backend_names(backends: set[str]) -> str:
    names = {"llamacpp": "llama.cpp", "onnx": "ONNX Runtime", "torch": "torch"}
    return ", ".join(names[b] for b in ("llamacpp", "onnx", "torch") if b in backends)


def _metadata(source: _Source) -> Path:
    """A GGUF source's tokenizer and config without weights (`convert.gguf_meta`), what a llama.cpp start reads."""
    from .convert import gguf_meta

    if source.meta_dir is None:
        source.meta_dir = gguf_meta(source.gguf, sha256=source.gguf_sha256)
    return source.meta_dir
