"""Memory budgets: will a model, its KV cache and its working memory fit where it is about to be loaded?

Loading a 7B target into a GPU that cannot hold it fails minutes later with an out-of-memory traceback, and on a
Jetson (unified memory: the GPU's memory is the system's RAM) it can take the whole board down with it. So before
the weights load, the runtime adds up what the model will hold (its weights in the dtype it will run in, its KV
cache at the longest context it allows, a working-memory margin) and compares the sum with what is free there: on
a GPU `torch.cuda.mem_get_info`, on unified memory and on the CPU the RAM available. What does not fit is one line
naming each part. The numbers are estimates (weights are exact, KV exact at that context, the margins are not),
and `scripts/gpu_check.py` records each estimate beside what torch really allocated.

It loads nothing and measures nothing itself; `available` is the only function that asks the machine.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import EdgespecError

GIB = 1024 ** 3
# What a torch model on CUDA uses beside its weights and KV cache: cuBLAS workspaces, the activations of a
# prefill, the allocator's slack. A margin, not a measurement (gpu_check.py compares it with the real peak).
TORCH_WORKSPACE = 512 * 1024 ** 2
# ONNX Runtime's arena beyond a model's weights and its KV buffers: the activations of a PREFILL_CHUNK-token feed.
ORT_ARENA_MIN = 128 * 1024 ** 2
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class Need:
    """What one model will hold: named parts in bytes, e.g. {"weights (bfloat16)": ..., "KV cache at 32768
    tokens": ...}."""

    what: str  # "the target", "the draft"
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return " + ".join(f"{name} {_gib(n)}" for name, n in self.parts.items())


def check_fits(need: Need, free: int, where: str, fix: str) -> None:
    """An EdgespecError, in one line, when `need` exceeds `free` bytes of `where`."""
    if need.total > free:
        raise EdgespecError(f"{need.what} does not fit: it needs {_gib(need.total)} ({need.describe()}) and "
                            f"{where} has {_gib(free)} free; {fix}")


def torch_need(what: str, hf_dir: Path, dtype_bytes: int, dtype_name: str, context: int | None = None) -> Need:
    """A transformers checkpoint run by torch: its parameters in the dtype it runs in, its KV cache at `context`
    tokens (default: the model's longest) in the same dtype, and `TORCH_WORKSPACE`."""
    config = _text_config(hf_dir)
    context = int(context or config.get("max_position_embeddings") or 2048)
    return Need(what, {f"weights ({dtype_name})": checkpoint_parameters(hf_dir) * dtype_bytes,
                       f"KV cache at {context} tokens": kv_bytes(config, context, dtype_bytes),
                       "working memory": TORCH_WORKSPACE})


def onnx_need(what: str, onnx_dir: Path, context: int | None = None) -> Need:
    """An ONNX Runtime model: its files (the weights as ORT holds them), its KV buffers at `context` tokens
    (default: the model's longest, which `OnnxLM` allocates at once on the CPU) and the arena's activations for
    a prefill chunk. The KV cache is float16 in a CUDA or fp16 export, float32 in a CPU one."""
    from .onnx_lm import PREFILL_CHUNK, _read_manifest

    onnx_dir = Path(onnx_dir)
    model = json.loads((onnx_dir / "genai_config.json").read_text(encoding="utf-8")).get("model", {})
    decoder = model.get("decoder", {})
    context = int(context or model.get("context_length") or 2048)
    manifest = _read_manifest(onnx_dir)
    kv_dtype_bytes = 2 if manifest.get("precision") == "fp16" or manifest.get("execution_provider", "cpu") != "cpu" \
        else 4
    layers, kv_heads, head = (int(decoder.get(k) or 0) for k in ("num_hidden_layers", "num_key_value_heads",
                                                                "head_size"))
    files = sum(p.stat().st_size for p in onnx_dir.iterdir() if p.is_file() and p.suffix in (".onnx", ".data"))
    arena = max(ORT_ARENA_MIN, PREFILL_CHUNK * int(decoder.get("hidden_size") or 0) * 16 * 4)
    return Need(what, {"weights": files, f"KV cache at {context} tokens": 2 * layers * kv_heads * head * context *
                       kv_dtype_bytes, "ONNX Runtime arena": arena})


def kv_bytes(config: dict, context: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for `context` tokens: 2 x layers x kv heads x head dim x context."""
    layers = int(config["num_hidden_layers"])
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return 2 * layers * kv_heads * head_dim * context * dtype_bytes


def checkpoint_parameters(hf_dir: Path) -> int:
    """The number of parameters in a checkpoint's safetensors files, read from their headers (no weights read).
    A checkpoint without safetensors is counted from its files' sizes as float32."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        return sum(p.stat().st_size for p in Path(hf_dir).glob("*.bin")) // 4
    count = 0
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= int(d)
                count += n
    return count


def available(device: str) -> tuple[int, str, bool]:
    """(free bytes, where, unified) for a model about to be loaded on `device` ("cpu", "cuda", "cuda:N"): a
    discrete GPU's free memory; on unified memory (a Jetson, an integrated GPU) and on the CPU, the RAM available,
    since that is what the GPU allocates from too."""
    import psutil

    ram = psutil.virtual_memory().available
    if not device.startswith("cuda"):
        return ram, "this machine's RAM", False
    import torch

    from .hardware import _jetson_model

    dev = torch.device(device)
    integrated = bool(getattr(torch.cuda.get_device_properties(dev), "is_integrated", False))
    if integrated or _jetson_model() is not None:
        free_gpu = torch.cuda.mem_get_info(dev)[0]
        return min(ram, free_gpu), f"{device} (unified memory: the GPU and the CPU share the RAM)", True
    return torch.cuda.mem_get_info(dev)[0], device, False


def _text_config(hf_dir: Path) -> dict:
    config = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def check_before_loading(device: str, need, fix: str) -> None:
    """Before a model loads on a GPU, or anywhere on a board whose GPU shares the RAM (a Jetson): an error when
    `need()` (a `Need`) exceeds what is free there. A plain CPU machine is left to its OS, as before."""
    from .hardware import _jetson_model

    if not (device.startswith("cuda") or _jetson_model() is not None):
        return
    free, where, _ = available(device)
    check_fits(need(), free, where, fix)


def torch_need_for(role: str, hf_dir: Path, device: str, dtype: str) -> Need:
    """`torch_need` for a checkpoint loaded as `load_causal_lm(device=device, dtype=dtype)` will load it."""
    import torch

    from .loading import pick_dtype

    chosen = pick_dtype(dtype, torch.device(device))
    return torch_need(f"the {role}", hf_dir, torch.finfo(chosen).bits // 8, str(chosen).removeprefix("torch."))
