"""One-off model conversions, cached by content: GGUF -> transformers checkpoint -> ONNX (INT4/INT8/FP32).

`gguf_to_hf` dequantises a GGUF file into a transformers checkpoint (weights, tokenizer with its chat
template, generation config): the source of both the PyTorch target and the ONNX export. `gguf_meta` writes the
same checkpoint without its weights (tokenizer, chat template, config, generation config): all a GGUF needs
when llama.cpp runs it as it is, in seconds and a few MB instead of a dequantisation and its disk.
`hf_to_onnx` runs onnxruntime-genai's model builder on such a checkpoint, in a subprocess.

Each result lives under `cache_dir()/"converted"`, in a directory named after a hash of its input's
content and of the options, so a second start finds it in well under a second. A result is built in a
`.partial-<pid>` sibling and renamed into place only once complete, with a manifest
(`edgespec-convert.json`) written last: an interrupted run leaves nothing that is later trusted, and a
directory without a manifest is rebuilt. The manifest records each file's size, mtime and sha256; a start
finds a result whose files went missing, were truncated or changed, and rebuilds it with a one-line notice
(`_damage`: sizes always, a hash only where an mtime moved). Progress goes to stderr.

Weights of a GGUF-derived checkpoint are stored in float16. The dequantised values (scale * q + min, with
fp16 scales) are exact in neither half format, but measured on SmolLM2-135M Q4_1 (512 positions of
prose, fp32 compute) float16 storage moved logits by at most 0.035 and changed no argmax (max relative
weight error 4.9e-4), while bfloat16 moved them by up to 0.17 and changed 0.6% of the argmaxes (max
relative error 3.9e-3). float32 would be exact but doubles the disk (6 GB instead of 3 GB for a 1.5B
model) for no measurable gain. A model whose dequantised weights overflow float16 is kept in float32.

This module does not download anything (that is `edgespec.models`), does not decide which model pair to
use, and does not load the results for inference (`edgespec.lm`, `edgespec.onnx_lm`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import EdgespecError
from .progress import bar as progress_bar
from .progress import cache_notice, report
from .paths import cache_dir, pid_alive

MANIFEST = "edgespec-convert.json"
# Bump when the output of a conversion changes for the same input, so stale cache entries are not reused.
HF_FORMAT = 1
META_FORMAT = 1
ONNX_FORMAT = 1
# INT4 settings chosen by measurement on SmolLM2-135M (docs/int4-choice.md, scripts/int4_sweep.py).
INT4_BLOCK_SIZE = 32
INT4_SYMMETRIC = False
INT4_ACCURACY_LEVEL = 4
INT4_LM_HEAD_INT8 = True
INT4_QUANTIZE_EMBEDDING = True

_GGUF_MAGIC = b"GGUF"
_HASH_CHUNK = 8 << 20
_BAR_FROM = 256 << 20  # bytes: a file this large is hashed with a progress bar (about a second or more)


def converted_dir() -> Path:
    """Where conversions are cached: `cache_dir()/"converted"`."""
    return cache_dir() / "converted"


# --------------------------------------------------------------------------------------------- GGUF -> HF


def gguf_to_hf(gguf_path: Path | str, *, sha256: str | None = None) -> Path:
    """A transformers checkpoint dir (float16 weights, tokenizer, chat template, generation config) for a GGUF.

    `sha256` is the file's known digest (from a manifest); without it the file is hashed (a few seconds a
    GB, remembered by size and mtime). The result is cached on that digest.
    """
    gguf_path = Path(gguf_path).absolute()  # not resolved: a hub cache's file is a link to a blob named by hash
    _check_gguf_magic(gguf_path)
    digest = (sha256 or file_sha256(gguf_path)).lower()
    key = _key({"kind": "gguf_to_hf", "format": HF_FORMAT, "sha256": digest})
    final = converted_dir() / "hf" / f"{_slug(gguf_path.stem)}-{key}"

    def build(staging: Path) -> dict:
        _check_gguf_tensors(gguf_path)
        dtype = _dequantise_gguf(gguf_path, staging)
        return {"kind": "hf", "source": str(gguf_path), "source_sha256": digest, "dtype": dtype}

    return _build_once(final, build, f"converting {gguf_path.name} to a transformers checkpoint")


def gguf_meta(gguf_path: Path | str, *, sha256: str | None = None) -> Path:
    """A transformers checkpoint dir without weights for a GGUF: tokenizer (chat template included), config.json
    and generation_config.json, the same files `gguf_to_hf` writes beside its weights. Cached on the GGUF's digest
    (`sha256` as in `gguf_to_hf`) under `converted_dir()/"meta"`."""
    gguf_path = Path(gguf_path).absolute()
    _check_gguf_magic(gguf_path)
    digest = (sha256 or file_sha256(gguf_path)).lower()
    key = _key({"kind": "gguf_meta", "format": META_FORMAT, "sha256": digest})
    final = converted_dir() / "meta" / f"{_slug(gguf_path.stem)}-{key}"

    def build(staging: Path) -> dict:
        _write_gguf_metadata(gguf_path, staging)
        return {"kind": "meta", "source": str(gguf_path), "source_sha256": digest}

    return _build_once(final, build, f"reading {gguf_path.name}'s tokenizer and config (no weights)")


def _write_gguf_metadata(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with _stage("reading the config"):
        try:
            config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
            _check_gguf_tensors(gguf_path)  # a truncated or garbled file: that one-line error first
            raise EdgespecError(
                f"transformers cannot read the config in {gguf_path.name} ({type(e).__name__}: {str(e)[:120]}); "
                "use a model whose architecture transformers' GGUF loader supports"
            ) from e
    tokenizer = _gguf_tokenizer(gguf_path)
    with _stage("saving the tokenizer and config"):
        # what `gguf_to_hf`'s save_pretrained writes: the causal LM's class as the architecture, and the generation
        # config made from the model config (eos and bos ids from the GGUF)
        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if architecture and not config.architectures:
            config.architectures = [architecture]
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        tokenizer.save_pretrained(out)


def _gguf_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    with _stage("loading the tokenizer"):
        try:
            return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except (KeyError, ValueError) as e:  # metadata transformers' GGUF tokenizer reader cannot map
            raise EdgespecError(
                f"transformers cannot read the tokenizer in {gguf_path.name} ({type(e).__name__}: {str(e)[:120]}); "
                "use a GGUF whose tokenizer metadata transformers supports"
            ) from e


_GGUF_FIX = "delete it and run `edgespec prepare` again"


def _check_gguf_magic(path: Path) -> None:
    """Fail with a one-line fix when `path` is missing or does not start like a GGUF file."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise EdgespecError(f"{path} does not exist; run `edgespec prepare` to fetch the model") from None
    except OSError as e:
        raise EdgespecError(f"cannot read {path} ({e.strerror}); check its permissions") from e
    if magic != _GGUF_MAGIC:
        raise EdgespecError(f"{path} is not a valid GGUF file (it does not start with 'GGUF'); {_GGUF_FIX}")


def _check_gguf_tensors(path: Path) -> None:
    """Fail with a one-line fix when the GGUF's header or tensor table is truncated or garbled."""
    from gguf import GGUFReader

    try:
        # Parses the header and maps every tensor: catches truncated and garbled files in well under a second.
        GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError) as e:
        raise EdgespecError(
            f"{path} is not a valid GGUF file ({type(e).__name__}: {str(e)[:120]}); {_GGUF_FIX}"
        ) from e


def _dequantise_gguf(gguf_path: Path, out: Path) -> str:
    """Load the GGUF through transformers (which dequantises it) and save a plain checkpoint; returns the dtype."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    def load(dtype):
        try:
            # dequantize=True: with the `kernels` package installed, transformers would otherwise keep the
            # weights in GGUF blocks, and save_pretrained would write those instead of plain tensors.
            return AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype,
                quantization_config=GgufConfig(gguf_file=gguf_path.name, dequantize=True),
            )
        except ValueError as e:  # transformers' way of saying "this architecture or quant type is unsupported"
            raise EdgespecError(
                f"transformers cannot load {gguf_path.name} ({str(e).splitlines()[0][:160]}); "
                "use a model whose architecture transformers' GGUF loader supports"
            ) from e

    with _stage("dequantising GGUF weights"), _tensor_bar(f"dequantising {gguf_path.name}"):
        # Casting each tensor right after it is dequantised keeps the peak memory at the float16 size.
        model = load(torch.float16)
        dtype = torch.float16
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            _note("the dequantised weights overflow float16; keeping float32")
            del model
            model, dtype = load(torch.float32), torch.float32
    tokenizer = _gguf_tokenizer(gguf_path)
    with _stage(f"saving the checkpoint ({str(dtype).removeprefix('torch.')})"):
        # A GGUF-loaded model refuses save_pretrained ("quantized with gguf and is not serializable") until
        # it forgets the GGUF quantizer: its weights are already plain dequantised tensors.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)  # writes generation_config.json too (eos and bos ids from the GGUF)
        tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------- HF -> ONNX


def hf_to_onnx(hf_dir: Path | str, *, precision: str = "int4", block_size: int = INT4_BLOCK_SIZE,
               symmetric: bool = INT4_SYMMETRIC, accuracy_level: int = INT4_ACCURACY_LEVEL,
               lm_head_int8: bool = INT4_LM_HEAD_INT8, quantize_embedding: bool = INT4_QUANTIZE_EMBEDDING,
               last_logits_only: bool = False, execution_provider: str = "cpu") -> Path:
    """An ONNX decoder with a KV cache (onnxruntime-genai builder layout) for a transformers checkpoint dir.

    `precision` is "int4" or "int8" (MatMulNBits weights in blocks of `block_size`, `symmetric` or with zero
    points; `accuracy_level` 4 quantises activations to int8, 0 keeps them float) or "fp32". For "int4",
    `lm_head_int8` keeps the LM head in 8 bits and `quantize_embedding` stores the embedding table in 4 bits
    instead of float32 (ORT's quantised Gather has no 8-bit form, so "int8" leaves it float32).
    `last_logits_only` prunes the LM head to the last position of each call (the builder's `prune_lm_head`):
    a drafter only ever needs that one row, and its prefill of a long prompt then skips a vocabulary-sized
    matmul per prompt token. A target verifying K+1 positions needs them all, so it keeps the full head.
    `execution_provider` is what the graph is built for: "cpu", or "cuda" (float16 activations and KV cache:
    ORT's CUDA provider registers GroupQueryAttention for float16/bfloat16 only, so a CPU graph on CUDA ran its
    attention on the CPU, copying the KV cache every layer). On "cuda" the precision is "fp16" or "int4"/"int8"
    (weights in 4/8 bits, float16 activations), without the CPU-tuned int4 extras (int8 activations, an 8-bit LM
    head, a 4-bit embedding table). Cached on the checkpoint's files (config, weights, tokenizer) and on the
    options, the execution provider included.
    """
    hf_dir = Path(hf_dir).resolve()
    config = _read_hf_config(hf_dir)
    if execution_provider not in ("cpu", "cuda"):
        raise EdgespecError(f"unknown ONNX execution provider {execution_provider!r}; use 'cpu' or 'cuda'")
    if execution_provider == "cuda" and precision == "fp32":
        raise EdgespecError("ONNX Runtime's CUDA provider runs attention in float16/bfloat16 only; export with "
                            "precision 'fp16' (or 'int4'/'int8') for CUDA")
    if execution_provider == "cuda" and precision in ("int4", "int8"):
        accuracy_level, lm_head_int8, quantize_embedding = 0, False, False
    if precision in ("int4", "int8"):
        options = {"precision": precision, "block_size": int(block_size), "is_symmetric": bool(symmetric),
                   "accuracy_level": int(accuracy_level)}
        if precision == "int4":
            options |= {"lm_head_int8": bool(lm_head_int8), "quantize_embedding": bool(quantize_embedding)}
    elif precision in ("fp32", "fp16"):
        options = {"precision": precision}
    else:
        raise EdgespecError(f"unknown ONNX precision {precision!r}; use 'int4', 'int8', 'fp32' or 'fp16'")
    if last_logits_only:
        options["last_logits_only"] = True
    if execution_provider != "cpu":  # (absent for the CPU, so the CPU exports' cache keys stay what they were)
        options["execution_provider"] = execution_provider
    builder_version = _builder_version()
    digest = dir_sha256(hf_dir)
    key = _key({"kind": "hf_to_onnx", "format": ONNX_FORMAT, "source": digest, "options": options,
                "builder": builder_version})
    final = converted_dir() / "onnx" / f"{_slug(_model_name(hf_dir))}-{precision}-{key}"

    def build(staging: Path) -> dict:
        _run_builder(hf_dir, staging, options, layers=int(config.get("num_hidden_layers") or 0),
                     architecture=",".join(config.get("architectures") or ["unknown architecture"]),
                     log=converted_dir() / "logs" / f"{final.name}.log")
        return {"kind": "onnx", "source": str(hf_dir), "source_sha256": digest, **options,
                "onnxruntime_genai": builder_version}

    return _build_once(final, build, f"exporting {hf_dir.name} to ONNX {precision}")


def _builder_version() -> str:
    """The model builder's version: onnxruntime-genai's, or onnxruntime-genai-cuda's (the same builder, installed
    under that name beside onnxruntime-gpu: `pip install 'edgespec[cuda]'`)."""
    for dist in ("onnxruntime-genai", "onnxruntime-genai-cuda"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    raise EdgespecError("onnxruntime-genai is not installed, and it exports models to ONNX; install it with "
                        "`pip install 'edgespec[cpu]'` (or 'edgespec[cuda]' on a CUDA machine)")


def _read_hf_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgespecError(f"{hf_dir} has no config.json, so it is not a transformers checkpoint; "
                            "point at the checkpoint dir or run `edgespec prepare` again") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EdgespecError(f"{path} is unreadable ({type(e).__name__}); delete {hf_dir} and run "
                            "`edgespec prepare` again") from e
    return config if isinstance(config, dict) else {}


def _builder_args(hf_dir: Path, out: Path, options: dict) -> list[str]:
    extra = {"hf_token": "false"}  # a local checkpoint: never look for Hugging Face credentials
    if options["precision"] in ("int4", "int8"):
        extra |= {"block_size": options["block_size"], "is_symmetric": str(options["is_symmetric"]).lower(),
                  "accuracy_level": options["accuracy_level"]}
    if options.get("lm_head_int8"):
        extra["matmul_mixed_precision"] = "last_matmul:int8"
    if options.get("quantize_embedding"):
        extra["op_types_to_quantize"] = "MatMul/Gather"
    if options.get("last_logits_only"):
        extra["prune_lm_head"] = "true"
    # For tied models the builder defaults to one matrix shared by embedding and LM head, and ORT 1.32
    # then rejects the INT4 graph ("Type (tensor(uint8)) of output arg (/model/embed_tokens/Reshape/output_0)
    # ... does not match expected type (tensor(float))"). Untied models get false anyway: one code path.
    extra["shared_embeddings"] = "false"
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
            "-p", options["precision"], "-e", options.get("execution_provider", "cpu"), "-c", str(out / ".builder-cache"),
            "--extra_options", *[f"{k}={v}" for k, v in extra.items()]]


def _run_builder(hf_dir: Path, out: Path, options: dict, *, layers: int, architecture: str, log: Path) -> None:
    """Run the builder into `out`, its output kept in `log`; a layer progress bar (`edgespec.progress.bar`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    layer_line = re.compile(r"^Reading (layer \d+|final norm|LM head)")
    with log.open("w", encoding="utf-8") as log_file, \
            progress_bar(layers + 2, f"exporting {hf_dir.name}: reading layers", unit="layer", tty_only=True) as bar:
        proc = subprocess.Popen(_builder_args(hf_dir, out, options), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", env=env)
        try:
            for line in proc.stdout:
                log_file.write(line)
                if layer_line.match(line):
                    bar.update(1)
                elif line.startswith("Saving ONNX model"):
                    bar.set_description(f"exporting {hf_dir.name}: saving" if options["precision"] == "fp32"
                                        else f"exporting {hf_dir.name}: quantising and saving")
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted (Ctrl-C): do not leave the builder running
                proc.kill()
                proc.wait()
    _note(f"builder finished in {time.monotonic() - start:.1f}s (log: {log})")
    if code != 0:
        raise EdgespecError(f"onnxruntime-genai's builder failed on {hf_dir.name} ({architecture}): "
                            f"{_last_error(log)}; read {log}, and check that the builder supports {architecture}")
    shutil.rmtree(out / ".builder-cache", ignore_errors=True)
    for name in ("model.onnx", "genai_config.json"):
        if not (out / name).is_file():
            raise EdgespecError(f"onnxruntime-genai's builder wrote no {name} for {hf_dir.name} ({architecture}); "
                                f"read {log}, and check that the builder supports {architecture}")


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(Error|Exception)\b|^error", ln, re.IGNORECASE)]
    return (errors or lines or ["no output"])[-1][:300]


# --------------------------------------------------------------------------------------------- hashing


def file_sha256(path: Path | str) -> str:
    """The sha256 of a file, remembered under the cache by (path, size, mtime) so a restart does not rehash."""
    path = Path(path).resolve()
    stat = path.stat()
    memo_path = converted_dir() / "digests.json"
    memo = _read_json(memo_path)
    stamp = [stat.st_size, stat.st_mtime_ns]
    entry = memo.get(str(path))
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry["sha256"]
    h = hashlib.sha256()
    # A bar only where hashing takes a while: a checkpoint's small files would each add a line in a front end.
    with path.open("rb") as f, progress_bar(stat.st_size, f"hashing {path.name}", tty_only=True,
                                            enabled=stat.st_size >= _BAR_FROM) as bar:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    digest = h.hexdigest()
    # Re-read just before writing so concurrent runs lose at most each other's newest entries.
    memo = _read_json(memo_path)
    memo = {p: e for p, e in memo.items() if os.path.exists(p)}  # forget files deleted since
    memo[str(path)] = {"stamp": stamp, "sha256": digest}
    _write_json_atomic(memo_path, memo)
    return digest


def dir_sha256(directory: Path | str) -> str:
    """A digest of the regular files directly in `directory` (names and contents), manifests excluded."""
    directory = Path(directory)
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST)
    if not files:
        raise EdgespecError(f"{directory} holds no files; point at a transformers checkpoint dir")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- the cache


def _build_once(final: Path, build: Callable[[Path], dict], what: str) -> Path:
    """Return `final` if a complete, intact build is there; otherwise build it in a staging dir and rename it in.

    The manifest records every file's size, mtime and sha256. A start checks the sizes (a stat per file) and
    hashes a file only where its mtime moved since the record; a file that is missing, truncated or changed
    makes the build count as damaged, and it is rebuilt with a one-line notice."""
    if (final / MANIFEST).is_file():
        damage = _damage(final)
        if damage is None:
            return final
        _note(f"the converted model in {final} is damaged ({damage}); rebuilding it")
        (final / MANIFEST).unlink(missing_ok=True)  # no longer trusted, by this process or another
    elif final.exists():
        _note(f"{final} holds no finished conversion (no {MANIFEST}); converting again")
    final.parent.mkdir(parents=True, exist_ok=True)
    if _remove_abandoned(final) and not final.exists():
        _note(f"an earlier conversion to {final.name} was interrupted; starting it again")
    staging = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    start = time.monotonic()
    cache_notice(cache_dir())
    _note(f"{what} (once; cached in {final})")
    try:
        manifest = build(staging)
        manifest |= {"seconds": round(time.monotonic() - start, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                     "files": _record(staging)}
        _write_json_atomic(staging / MANIFEST, manifest)  # last: its presence marks the build complete
        # If another process finished the same conversion meanwhile, its result is as good as ours: keep it.
        if not (final / MANIFEST).is_file():
            if final.exists():  # no manifest: not ours to trust (copied in half, or edited by hand)
                shutil.rmtree(final)
            try:
                staging.rename(final)
            except OSError:
                if not (final / MANIFEST).is_file():
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _note(f"done in {time.monotonic() - start:.1f}s")
    return final


def _remove_abandoned(final: Path) -> bool:
    """Delete staging dirs of `final` left by processes that no longer run (killed mid-conversion); whether
    there was one."""
    found = False
    for partial in final.parent.glob(f".{final.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)
            found = True
    return found


def _record(directory: Path) -> dict[str, dict]:
    """Size, mtime and sha256 of every file under `directory` (the manifest aside), by relative path."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name != MANIFEST:
            st = p.stat()
            out[p.relative_to(directory).as_posix()] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                                        "sha256": _sha256(p)}
    return out


def _damage(final: Path) -> str | None:
    """What is wrong with the build in `final` against its manifest's record (None: intact).

    Every start stats each recorded file; only a file whose mtime moved since the record is hashed (then the
    new mtime is recorded, so it is hashed once). A same-size, same-mtime change to a file goes unnoticed:
    hashing the 1-2 GB of a converted 1.5B model at every start would cost seconds each time. A manifest
    written before files were recorded gets its record now (hashing once), and is trusted."""
    manifest = _read_json(final / MANIFEST)
    if not manifest:
        return f"its {MANIFEST} is unreadable"
    files = manifest.get("files")
    if files is None:
        _note(f"recording the sizes and hashes of {final.name} (once)")
        manifest["files"] = _record(final)
        _write_json_atomic(final / MANIFEST, manifest)
        return None
    if not isinstance(files, dict) or not files:
        return f"its {MANIFEST} has no valid record of its files"
    moved = False
    for rel, rec in files.items():
        if not (isinstance(rec, dict) and isinstance(rec.get("size"), int) and isinstance(rec.get("sha256"), str)):
            return f"its {MANIFEST} has no valid record of {rel}"
        path = final / rel
        try:
            st = path.stat()
        except OSError:
            return f"{rel} is missing"
        if not path.is_file():
            return f"{rel} is not a file"
        if st.st_size != rec["size"]:
            return f"{rel} has {st.st_size} bytes, {rec['size']} when it was written"
        if st.st_mtime_ns != rec.get("mtime_ns"):
            if _sha256(path) != rec["sha256"]:
                return f"{rel} changed since it was written (its sha256 differs)"
            rec["mtime_ns"], moved = st.st_mtime_ns, True
    if moved:  # the same content under a new mtime (copied, touched): hash it once, not at every start
        _write_json_atomic(final / MANIFEST, manifest)
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _model_name(directory: Path) -> str:
    """A checkpoint's name for its conversions' folder: a hub cache snapshot (models--org--name/snapshots/<commit>)
    by its repo, anything else by its folder's name."""
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent.name.removeprefix("models--")
    return directory.name


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:60] or "model"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------- progress


def _note(message: str) -> None:
    report(message)


@contextmanager
def _tensor_bar(label: str) -> Iterator[None]:
    """One bar over the GGUF's tensors while transformers dequantises them: its loader iterates them through
    the `tqdm` its module imported, swapped here for ours (on stderr, or the front end's sink). A transformers
    without that name keeps its own bar."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    def ours(iterable=None, *args, **kwargs):
        total = len(iterable) if hasattr(iterable, "__len__") else None
        return progress_bar(total, label, unit="tensor", tty_only=True, iterable=iterable)

    gguf_utils.tqdm = ours
    try:
        yield
    finally:
        gguf_utils.tqdm = original


@contextmanager
def _stage(what: str) -> Iterator[None]:
    """Print a line when a stage starts and its elapsed time when it ends."""
    start = time.monotonic()
    _note(f"  {what}...")
    yield
    _note(f"  {what}: {time.monotonic() - start:.1f}s")
