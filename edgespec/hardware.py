"""What is here: CPU, memory, CUDA GPUs, ONNX Runtime providers, library versions, a Jetson board.

Placement decisions (which device verifies, which drafts) and profiles (`edgespec.profiling`: each records the machine
they were measured on) read `describe()`. `check_device` turns a user's device string into one that is
known to work here, or a one-line error saying what to use instead.

It measures nothing (see `edgespec.profiling`) and records no hostname, user name or serial number, so a
description can be committed alongside a profile. Heavy imports (torch, onnxruntime) happen inside the
functions that need them, so importing this module is cheap.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import EdgespecError

# CPU features that decide which kernels are fast: bf16/int8 dot products on x86 (AVX-512, AMX, VNNI) and
# their ARM counterparts (dot product, i8mm, bf16, SVE) on Jetson and other ARM boards.
X86_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_bf16", "amx_int8", "amx_tile")
ARM_FLAGS = ("asimd", "asimdhp", "asimddp", "fphp", "i8mm", "bf16", "sve", "sve2")
DEVICE_CHOICES = "cpu, cuda, cuda:N or auto"

_CPUINFO = Path("/proc/cpuinfo")
_DEVICE_TREE_MODEL = Path("/proc/device-tree/model")


@dataclass
class Hardware:
    """A description of this machine. Sizes are bytes; versions are None when the library is absent."""

    system: str
    python: str
    cpu_model: str
    cpu_flags: dict[str, bool]
    cores_physical: int
    cores_logical: int
    cores_usable: int  # what this process may run on (container CPU sets, taskset)
    memory_total: int
    memory_available: int
    memory_limit: int | None  # a cgroup (container) limit below the physical total, if any
    cuda_available: bool
    cuda_devices: list[dict] = field(default_factory=list)  # index, name, total_memory, capability, integrated
    cuda_note: str = ""  # why CUDA is unavailable, in words
    torch: str | None = None
    torch_cuda: str | None = None  # the CUDA version torch was built for; None for a CPU-only build
    transformers: str | None = None
    onnxruntime: str | None = None
    onnxruntime_genai: str | None = None
    ort_providers: list[str] = field(default_factory=list)
    llama_cpp: str | None = None  # llama-cpp-python's version (the GGUF target backend), None: not installed
    jetson: str | None = None  # the board's model string
    unified_memory: bool = False  # GPU and CPU share RAM (Jetson, integrated GPUs): one memory budget

    def to_dict(self) -> dict:
        return asdict(self)


def overlap_split(cores: int, *, target_on_gpu: bool = False) -> tuple[int | None, int] | None:
    """ONNX Runtime threads (target, draft) when the drafter drafts on its own thread while the target verifies
    (`--overlap`); None where there is nothing to split (one core: the two would only take turns).

    A target on the GPU keeps one core to launch its kernels (its threads: None, torch's own) and the draft
    gets the rest. On the CPU the draft, a model several times smaller, gets a quarter of the cores (at least
    one) and the target the rest: verifying K+1 tokens spreads over threads better than proposing one token at
    a time does. A default only: `edgespec profile` measures the split it uses, and --threads/--draft-threads
    set another."""
    if target_on_gpu:
        return None, max(1, cores - 1)
    if cores < 2:
        return None
    draft = max(1, cores // 4)
    return cores - draft, draft


def describe() -> Hardware:
    """Probe this machine. Takes about as long as importing torch and onnxruntime."""
    import psutil

    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    # psutil answers None for physical cores where it cannot tell (some ARM boards, containers).
    physical = psutil.cpu_count(logical=False) or logical
    mem = psutil.virtual_memory()
    limit = _cgroup_memory_limit()
    jetson = _jetson_model()
    hw = Hardware(
        system=f"{platform.system()} {platform.release()} {platform.machine()}",
        python=platform.python_version(),
        cpu_model=_cpu_model(),
        cpu_flags=cpu_flags(),
        cores_physical=physical,
        cores_logical=logical,
        cores_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical,
        memory_total=mem.total,
        memory_available=mem.available,
        memory_limit=limit if limit is not None and limit < mem.total else None,
        cuda_available=False,
        transformers=_version("transformers"),
        onnxruntime_genai=_version("onnxruntime-genai") or _version("onnxruntime-genai-cuda"),
        llama_cpp=_version("llama-cpp-python"),
        jetson=jetson,
        unified_memory=jetson is not None,
    )
    _probe_torch(hw)
    _probe_onnxruntime(hw)
    return hw


def cpu_flags() -> dict[str, bool]:
    """Presence of the CPU features in X86_FLAGS or ARM_FLAGS (by architecture); empty where unknown."""
    text = _read_text(_CPUINFO)
    if text is None:
        return {}
    for key, names in (("flags", X86_FLAGS), ("Features", ARM_FLAGS)):
        m = re.search(rf"^{key}\s*:\s*(.*)$", text, re.MULTILINE)
        if m:
            present = set(m.group(1).split())
            return {name: name in present for name in names}
    return {}


def check_device(name: str, *, flag: str = "--target-device") -> str:
    """The torch device string to use for `name` ("cpu", "cuda", "cuda:N", "auto"), or an EdgespecError.

    `flag` is the CLI option the string came from, so the message names what the user typed.
    """
    device = name.strip().lower()
    if device == "cpu":
        return "cpu"
    if device == "auto":
        return "cuda" if _cuda_count() > 0 else "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if not m:
        raise EdgespecError(f"unknown device {name!r} for {flag}; use {DEVICE_CHOICES}")
    require_cuda(device, flag=flag)
    if m.group(1) is not None:
        index, count = int(m.group(1)), _cuda_count()
        if index >= count:
            raise EdgespecError(f"{flag} {device} asks for GPU {index} but this machine has {count} CUDA GPU(s) "
                                f"(cuda:0..cuda:{count - 1}); use one of those or {flag} cpu")
    return device


def require_cuda(requested: str = "cuda", *, flag: str = "--target-device") -> None:
    """Raise an EdgespecError saying why, when no CUDA GPU is usable here."""
    if _cuda_count() > 0:
        return
    raise EdgespecError(f"CUDA was requested ({flag} {requested}) but no CUDA GPU is available here "
                        f"({_why_no_cuda()}); use {flag} cpu")


def format_devices(hw: Hardware) -> str:
    """A readable multi-line report for `edgespec devices`."""
    gib = 1024 ** 3
    flags = hw.cpu_flags
    have = " ".join(k for k, v in flags.items() if v) or "none of note"
    missing = " ".join(k for k, v in flags.items() if not v)
    memory = f"{hw.memory_total / gib:.1f} GiB total, {hw.memory_available / gib:.1f} GiB available"
    if hw.memory_limit is not None:
        memory += f", container limit {hw.memory_limit / gib:.1f} GiB"
    lines = [
        f"system        {hw.system}, Python {hw.python}",
        f"cpu           {hw.cpu_model}: {hw.cores_physical} physical / {hw.cores_logical} logical cores "
        f"({hw.cores_usable} usable)",
        f"cpu features  {have}" + (f" (absent: {missing})" if missing else ""),
        f"memory        {memory}",
    ]
    if hw.cuda_devices:
        lines.append(f"cuda          {len(hw.cuda_devices)} GPU(s), torch built for CUDA {hw.torch_cuda}")
        for d in hw.cuda_devices:
            lines.append(f"  cuda:{d['index']:<7} {d['name']}, {d['total_memory'] / gib:.1f} GiB, "
                         f"compute {d['capability']}" + (", integrated" if d.get("integrated") else ""))
    else:
        lines.append(f"cuda          none ({hw.cuda_note})")
    if hw.jetson:
        lines.append(f"jetson        {hw.jetson} (unified memory: the GPU shares the {hw.memory_total / gib:.1f} "
                     f"GiB of system RAM)")
    split = overlap_split(hw.cores_usable, target_on_gpu=bool(hw.cuda_devices))
    if split is None:
        lines.append("overlap       no: one usable core, so drafting cannot run beside verification")
    else:
        target_threads = "the GPU" if split[0] is None else f"{split[0]} thread{'s' * (split[0] > 1)}"
        lines.append(f"overlap       --overlap splits the cores: target {target_threads}, draft {split[1]} "
                     f"thread{'s' * (split[1] > 1)} (--threads / --draft-threads set others)")
    providers = ", ".join(hw.ort_providers) or "none"
    lines.append(f"onnxruntime   {hw.onnxruntime or 'not installed'}; providers: {providers}")
    lines.append(f"llama.cpp     {_llama_cpp_line(hw)}")
    lines.append(f"libraries     torch {hw.torch or 'not installed'}, transformers "
                 f"{hw.transformers or 'not installed'}, onnxruntime-genai {hw.onnxruntime_genai or 'not installed'}")
    return "\n".join(lines)


def _llama_cpp_line(hw: Hardware) -> str:
    """The GGUF backend: installed or not, and what its llama.cpp was built for."""
    if hw.llama_cpp is None:
        from .llamacpp_lm import INSTALL_HINT

        return f"not installed (GGUF targets run converted under ONNX Runtime; {INSTALL_HINT})"
    from .llamacpp_lm import build_info

    info = build_info()
    gpu = "with GPU offload" if info.get("gpu_offload") else "CPU only"
    return f"llama-cpp-python {hw.llama_cpp}, {gpu} build (--target-backend llamacpp)"


# ---------------------------------------------------------------------------------------------- probes


def _probe_torch(hw: Hardware) -> None:
    try:
        import torch
    except ImportError:
        hw.cuda_note = "torch is not installed"
        return
    hw.torch = torch.__version__
    hw.torch_cuda = torch.version.cuda
    count = _cuda_count()
    hw.cuda_available = count > 0
    if count == 0:
        hw.cuda_note = _why_no_cuda()
        return
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        integrated = bool(getattr(props, "is_integrated", False))
        hw.cuda_devices.append({"index": i, "name": props.name, "total_memory": props.total_memory,
                                "capability": f"{props.major}.{props.minor}", "integrated": integrated})
        hw.unified_memory = hw.unified_memory or integrated


def _probe_onnxruntime(hw: Hardware) -> None:
    try:
        import onnxruntime
    except ImportError:
        return
    hw.onnxruntime = onnxruntime.__version__
    hw.ort_providers = list(onnxruntime.get_available_providers())


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        # A broken driver install makes torch raise here instead of answering False; treat it as no GPU,
        # and _why_no_cuda says what torch saw.
        return 0


def _why_no_cuda() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return (f"torch {torch.__version__} was built for CUDA {torch.version.cuda} but sees no GPU; "
            f"check the driver with nvidia-smi")


def _cpu_model() -> str:
    text = _read_text(_CPUINFO) or ""
    # x86 says "model name"; ARM boards often only have "Hardware" or nothing useful, hence the fallbacks.
    for key in ("model name", "Hardware", "Processor"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text, re.MULTILINE)
        if m and m.group(1).strip():
            return m.group(1).strip()
    return platform.processor() or platform.machine() or "unknown"


def _jetson_model() -> str | None:
    text = _read_text(_DEVICE_TREE_MODEL)
    if text is None:
        return None
    model = text.replace("\x00", "").strip()
    return model if ("jetson" in model.lower() or "nvidia" in model.lower()) else None


def _cgroup_memory_limit() -> int | None:
    # cgroup v2, then v1. v1 reports "no limit" as a huge number; the caller ignores limits above the total.
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        text = _read_text(path)
        if text is not None and text.strip().isdigit():
            return int(text.strip())
    return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _version(dist: str) -> str | None:
    # Package metadata, not an import: importing transformers alone takes seconds.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
