"""The ONNX Runtime backend of the `CausalLM` contract: a decoder exported by onnxruntime-genai's builder.

`OnnxLM` wraps one plain `onnxruntime.InferenceSession` over a directory written by
`edgespec.convert.hf_to_onnx` (`model.onnx`, its external data, `genai_config.json`) and owns the KV cache
as one preallocated buffer per layer that the graph updates in place, so a rollback is only a length.
It does not use onnxruntime-genai's generator (which owns its cache and cannot crop it to an arbitrary
length), it runs batch 1 only, and it knows nothing about tokenizers, sampling or speculation.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from .errors import EdgespecError
from .lm import check_feed, feed_padded

# The builder's I/O names; genai_config.json may spell them out, and then we read them from there.
_PAST_KEY, _PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
_PRESENT_KEY, _PRESENT_VALUE = "present.%d.key", "present.%d.value"
_MIN_CAPACITY = 256  # KV positions allocated at first on a GPU; the buffer doubles from there as the chat grows
# A feed longer than this (a prefill) runs in chunks of it: ORT computes and allocates the logits of every row it
# runs (a target's LM head is not pruned) and its arena keeps the peak: one 2,400-token SmolLM2 feed added 1 GB of
# RSS for good, the same tokens in 256-token chunks 200 MB (scripts/soak.py, docs/soak/).
PREFILL_CHUNK = 256
_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def _ort_errors() -> tuple[type[BaseException], ...]:
    """The exceptions onnxruntime raises for a model it cannot load (they derive from Exception directly)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf", "NoSuchFile", "NoModel",
             "NotImplemented", "RuntimeException", "EngineError")
    return tuple(getattr(state, n) for n in names if hasattr(state, n))


def default_threads() -> int:
    """The cores this process may run on (respects taskset and cgroup cpusets, unlike os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class OnnxLM:
    """A decoder-only ONNX model (input_ids, attention_mask, past KV -> logits, present KV) and its cache.

    `threads` sets ORT's intra-op pool (default: every core this process may use); `device` is "cpu", "cuda" or
    "cuda:N" (ORT's CUDA execution provider on GPU N, which must be installed: onnxruntime-gpu, `edgespec[cuda]`;
    a model exported for it: `hf_to_onnx(..., execution_provider="cuda")`). ORT falls back to the CPU without a
    word when the CUDA provider cannot start (a CUDA or cuDNN library missing), so the session's active providers
    are checked after it is created, and a missing library is named.

    `min_rows`: a feed shorter than this runs as `min_rows` rows, the last id repeated, and keeps only its
    own rows. ORT's CPU kernels compute a one-token step differently from a step of several tokens (different
    rounding), while steps of two or more tokens give every row bitwise the same result whatever their count
    (measured on the INT4 Qwen2.5 1.5B export: a single step's logits differ by up to 0.17). With `min_rows=2`
    plain decoding therefore takes the same numbers as verifying a block of drafts, and greedy output is the
    same token for token at every K (`--exact`, which sets it from `edgespec.lm.exact_rows`), at the price of
    one more row per step without a draft (6-10% slower plain decoding there).
    """

    def __init__(self, onnx_dir: Path | str, *, threads: int | None = None, device: str = "cpu",
                 name: str = "model", min_rows: int = 1):
        try:
            import onnxruntime as ort  # local: keep `import edgespec` light
        except ImportError:
            raise EdgespecError("ONNX Runtime is not installed; `pip install 'edgespec[cpu]'` (or 'edgespec[cuda]' "
                                "on a CUDA machine, docs/gpu.md)") from None

        onnx_dir = Path(onnx_dir)
        fix = f"delete {onnx_dir} and run `edgespec prepare` again"
        genai = _read_genai_config(onnx_dir, fix)
        model_cfg = genai["model"]
        decoder = model_cfg.get("decoder", {})
        model_path = onnx_dir / decoder.get("filename", "model.onnx")
        if not model_path.is_file():
            raise EdgespecError(f"{model_path} is missing; {fix}")
        if not genai.get("search", {}).get("past_present_share_buffer", False):
            # Our cache relies on GroupQueryAttention updating a shared past/present buffer in place.
            raise EdgespecError(f"{model_path} was not exported with an in-place KV cache; {fix}")

        providers = ort_providers(device)
        if device != "cpu" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise EdgespecError(f"this onnxruntime ({ort.__version__}) has no CUDA execution provider; install "
                                f"onnxruntime-gpu in its place (`pip install 'edgespec[cuda]'`, docs/gpu.md) or run "
                                f"the model on the CPU")

        options = ort.SessionOptions()
        self.threads = int(threads or default_threads())
        options.intra_op_num_threads = self.threads
        # The decoder graph is one chain of ops: a second pool would only contend for the same cores.
        options.inter_op_num_threads = 1
        if os.environ.get("EDGESPEC_ORT_SPIN", "0") != "1":
            # Draft and target sessions take turns on the same cores: a pool that spin-waits after its run
            # steals the cores the other session needs next.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.log_severity_level = 3  # ORT warns about unused initializers in builder graphs: noise
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=providers)
        except _ort_errors() as e:
            lines = str(e).strip().splitlines()
            reason = lines[0][:200] if lines else type(e).__name__
            raise EdgespecError(f"cannot load {model_path} ({reason}); {fix}") from e
        if device != "cpu" and "CUDAExecutionProvider" not in self.session.get_providers():
            raise EdgespecError(f"ONNX Runtime's CUDA provider did not start, so {model_path.name} would run on the "
                                f"CPU ({cuda_provider_problem(ort)}); install the CUDA and cuDNN libraries this "
                                f"onnxruntime-gpu was built for (`pip install 'onnxruntime-gpu[cuda,cudnn]'`) or "
                                f"run the model on the CPU")
        self._device_id = providers[0][1]["device_id"] if device != "cpu" else 0

        in_names = decoder.get("inputs", {})
        out_names = decoder.get("outputs", {})
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        self._input_ids = in_names.get("input_ids", "input_ids")
        self._attention_mask = in_names.get("attention_mask", "attention_mask")
        self._position_ids = in_names.get("position_ids", "position_ids")
        self._has_position_ids = self._position_ids in inputs
        self._logits = out_names.get("logits", "logits")
        past_key = in_names.get("past_key_names", _PAST_KEY)
        past_value = in_names.get("past_value_names", _PAST_VALUE)
        present_key = out_names.get("present_key_names", _PRESENT_KEY)
        present_value = out_names.get("present_value_names", _PRESENT_VALUE)
        layers = 0
        while past_key % layers in inputs:
            layers += 1
        self._past_names = [p % i for i in range(layers) for p in (past_key, past_value)]
        self._present_names = [p % i for i in range(layers) for p in (present_key, present_value)]
        expected = [self._input_ids, self._attention_mask, *self._past_names]
        if layers == 0 or any(n not in inputs for n in expected) or self._logits not in outputs \
                or any(n not in outputs for n in self._present_names):
            raise EdgespecError(f"{model_path} is not a decoder with a KV cache that edgespec can drive; {fix}")

        past = inputs[self._past_names[0]]
        self._kv_dtype = _ORT_DTYPES.get(past.type)
        if self._kv_dtype is None:
            raise EdgespecError(f"{model_path} has a {past.type} KV cache, which edgespec cannot hold; {fix}")
        # The head dim is symbolic ("kv_cache_dim") in builder exports, so the config is the reliable source.
        kv_heads = past.shape[1] if isinstance(past.shape[1], int) else decoder.get("num_key_value_heads")
        head_dim = past.shape[3] if isinstance(past.shape[3], int) else decoder.get("head_size")
        vocab = outputs[self._logits].shape[-1]
        # A pruned LM head (`hf_to_onnx(..., last_logits_only=True)`, for drafters) yields one row per call.
        self.last_logits_only = outputs[self._logits].shape[1] == 1
        vocab = vocab if isinstance(vocab, int) else model_cfg.get("vocab_size")
        context = model_cfg.get("context_length") or genai.get("search", {}).get("max_length")
        if not all(isinstance(v, int) for v in (kv_heads, head_dim, vocab, context)):
            raise EdgespecError(f"{onnx_dir / 'genai_config.json'} lacks the model's shape; {fix}")
        self._kv_heads, self._head_dim = kv_heads, head_dim

        self.vocab_size = vocab
        self.max_context = context
        self.eos_token_ids = _as_list(model_cfg.get("eos_token_id"))
        self.device = device
        precision = _read_manifest(onnx_dir).get("precision", "onnx")
        self.description = f"onnxruntime {device} {precision}"

        self._ort = ort
        self._binding = self.session.io_binding()
        # Bound first so it stays output 0: get_outputs() lists outputs in the order they were first bound.
        self._binding.bind_output(self._logits, "cpu")
        # CPU OrtValues made from numpy borrow its memory: the arrays stay referenced here.
        self._kv_arrays: list[np.ndarray] = []
        self._kv_values: list = []
        self._capacity = 0
        self._length = 0
        self.min_rows = int(min_rows)

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._length = 0

    def reserve(self, total: int) -> None:
        """Nothing to size ahead: the KV buffers are allocated for the whole context on the CPU (and grow as feeds
        need them on a GPU: `_reserve`)."""

    def feed(self, ids: list[int], logits_for: int) -> torch.Tensor:
        if not ids:
            return torch.empty(0, self.vocab_size)
        n = len(ids)
        check_feed(n, logits_for, self._length, self.max_context)
        if n < self.min_rows and not self.last_logits_only and self._length + self.min_rows <= self.max_context:
            return feed_padded(self, ids, logits_for)
        if n > PREFILL_CHUNK:
            return self._feed_chunked(ids, logits_for)
        if logits_for > 1 and self.last_logits_only:
            raise ValueError(f"{self.description} computes the last position's logits only (pruned LM head), "
                             f"asked for {logits_for}; use a model exported without last_logits_only")
        total = self._length + n
        self._reserve(total)
        io = self._binding
        io.bind_cpu_input(self._input_ids, np.asarray([ids], dtype=np.int64))
        # GroupQueryAttention takes the past length from the mask (its sum minus n) and never reads the
        # buffer beyond it, so the mask is all ones and exactly as long as the real sequence.
        io.bind_cpu_input(self._attention_mask, np.ones((1, total), dtype=np.int64))
        if self._has_position_ids:
            io.bind_cpu_input(self._position_ids, np.arange(self._length, total, dtype=np.int64)[None, :])
        io.bind_output(self._logits, "cpu")  # bound again each step because its shape follows n
        self.session.run_with_iobinding(io)
        self._length = total
        if logits_for == 0:
            return torch.empty(0, self.vocab_size)
        logits = io.get_outputs()[0].numpy()
        rows = logits.shape[1]
        return torch.from_numpy(np.ascontiguousarray(logits[0, rows - logits_for:], dtype=np.float32))

    def _feed_chunked(self, ids: list[int], logits_for: int) -> torch.Tensor:
        """`feed` in chunks of `PREFILL_CHUNK` tokens, each returning the rows of the last `logits_for` it holds."""
        n, first_wanted, rows = len(ids), len(ids) - logits_for, []
        for start in range(0, n, PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, n)
            rows.append(self.feed(ids[start:end], max(0, end - max(start, first_wanted))))
        return torch.cat(rows) if logits_for else torch.empty(0, self.vocab_size)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} tokens to {length}")
        # What lies past `length` is stale but never read again, and the next step overwrites it.
        self._length = length

    def _reserve(self, total: int) -> None:
        """Make the KV buffers hold at least `total` positions, keeping the cached ones.

        Each past input and its present output are bound to the same buffer, which GroupQueryAttention
        then updates in place: a step copies nothing and a crop is free. Measured on SmolLM2-135M INT4,
        1 thread, 4000 cached tokens: 22 ms a step this way, 34 ms when ORT concatenates past and new
        into a fresh present, and 123 ms when a rollback also has to copy the kept slice.
        """
        if total <= self._capacity:
            return
        if self.device == "cpu":
            # The whole context at once: np.zeros takes fresh zero pages from the OS, which count in RSS only when
            # written, so the buffers cost what the chat has used and are never copied or left behind by a
            # doubling (that grew RSS in steps of 100-240 MB for good, long after the chat had warmed up).
            capacity = self.max_context
        else:
            capacity = min(self.max_context, max(total, 2 * self._capacity, _MIN_CAPACITY))
        arrays, values = [], []
        for i in range(len(self._past_names)):
            array = np.zeros((1, self._kv_heads, capacity, self._head_dim), dtype=self._kv_dtype)
            if self._length:
                old = self._kv_arrays[i] if self.device == "cpu" else self._kv_values[i].numpy()
                array[:, :, :self._length] = old[:, :, :self._length]
            if self.device == "cpu":
                arrays.append(array)
                values.append(self._ort.OrtValue.ortvalue_from_numpy(array))
            else:
                # Growing a GPU buffer goes through host memory; it happens a handful of times a session.
                values.append(self._ort.OrtValue.ortvalue_from_numpy(array, "cuda", self._device_id))
        self._kv_arrays, self._kv_values = arrays, values
        for past, present, value in zip(self._past_names, self._present_names, values):
            self._binding.bind_ortvalue_input(past, value)
            self._binding.bind_ortvalue_output(present, value)
        self._capacity = capacity


def ort_providers(device: str) -> list:
    """ONNX Runtime's providers for "cpu", "cuda" or "cuda:N" (the CUDA provider on GPU N, the CPU one for the
    few nodes it does not take)."""
    if device == "cpu":
        return ["CPUExecutionProvider"]
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        raise EdgespecError(f"unknown ONNX Runtime device {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
    return [("CUDAExecutionProvider", {"device_id": int(m.group(1) or 0)}), "CPUExecutionProvider"]


def cuda_provider_problem(ort) -> str:
    """Why ORT's CUDA provider did not start, in words: its library is absent (a CPU build), or the first library
    it needs that the loader cannot find (e.g. "libcudnn.so.9: cannot open shared object file")."""
    library = _cuda_provider_library(ort)
    if not library.is_file():
        return f"this onnxruntime {ort.__version__} has no {library.name}: it is the CPU build"
    try:
        ctypes.CDLL(str(library))
    except OSError as err:
        return f"{library.name} cannot load: {str(err).split(library.name + ': ')[-1][:200]}"
    return f"{library.name} loads here, so the reason is in ONNX Runtime's own log"


def _cuda_provider_library(ort) -> Path:
    name = "onnxruntime_providers_cuda.dll" if os.name == "nt" else "libonnxruntime_providers_cuda.so"
    return Path(ort.__file__).parent / "capi" / name


def _read_genai_config(onnx_dir: Path, fix: str) -> dict:
    path = onnx_dir / "genai_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgespecError(f"{path} is missing, so {onnx_dir} is not a converted model; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EdgespecError(f"{path} is unreadable ({type(e).__name__}); {fix}") from e
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise EdgespecError(f"{path} has no 'model' section; {fix}")
    return config


def _read_manifest(onnx_dir: Path) -> dict:
    """What `edgespec.convert` recorded about this export (precision, options); {} for a foreign dir."""
    try:
        data = json.loads((onnx_dir / "edgespec-convert.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
