"""GGUF models on llama.cpp's own kernels: the `CausalLM` contract over llama-cpp-python's low-level API.

The GGUF runs as it is (no dequantising, no conversion, no second copy on disk), with the kernels llama.cpp
has for its format on this CPU (or GPU, in a CUDA/Metal build). One sequence, one KV cache:
- `feed(ids, logits_for)`: `llama_decode` of the new tokens in chunks of at most `n_batch` (a larger batch
  aborts the process), logits flagged for the last `logits_for` only; the rows are copied out before the next
  decode overwrites them.
- `crop(length)`: `llama_memory_seq_rm` from `length` on. A recurrent or hybrid model's memory cannot be
  partly removed, so such models are refused at load with a one-line error.
- threads: llama.cpp uses `threads` for one-token steps and `batch_threads` for steps of several tokens
  (verification, prefill); both default to every core this process may use.
- one thread of ours calls llama.cpp (`Runner`): llama.cpp's CPU kernels run in an OpenMP team that belongs to
  the calling thread, and GNU OpenMP stops spinning at its barriers as soon as the teams alive in the process
  hold more threads than there are cores. So a program that asked from two long-lived threads (the main one,
  then a worker pool's) made every step wait on futexes: 35% slower on 2 cores (docs/serve.md). All models
  that use several threads hand their steps to one long-lived thread instead (an overlapped drafter, which must
  run beside the target, gets its own); a one-thread model makes no team and is called directly. The engine
  runs a request's whole loop on that thread (`Runner.stream`), a round ahead of its caller, so no step waits
  for two thread switches (4% of a SmolLM2 step on 2 cores, measured per step against llama.cpp's own loop).

Installed with the `llamacpp` extra (llama-cpp-python compiles llama.cpp at install).
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import EdgespecError
from .lm import check_feed, feed_padded

INSTALL_HINT = "pip install 'edgespec[llamacpp]' (compiles llama.cpp: several minutes)"
DEFAULT_CONTEXT = 8192  # the KV cache is allocated up front: at most this many tokens unless asked for more
_backend_lock = threading.Lock()
_backend_ready = False
_log_callback = None  # kept referenced: llama.cpp calls it from C


class Runner:
    """One long-lived thread that makes the llama.cpp calls handed to it, in order (see the module's text)."""

    def __init__(self, name: str):
        self.name = name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def call(self, fn, *args):
        """`fn(*args)` on the runner's thread; its result or its exception here. The call runs to its end even
        if this thread is interrupted while it waits (Ctrl-C), so the model's state stays whole."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        box: list = []
        done = self._submit(self._boxed, box, fn, args)
        try:
            done.acquire()
        except BaseException:  # Ctrl-C: let the call in flight end (a second one stops waiting for it)
            done.acquire()
            raise
        ok, value = box
        if ok:
            return value
        raise value

    def stream(self, items: Iterator) -> Iterator:
        """The items of the generator `items`, made on the runner's thread ahead of the caller: the runner makes
        the next as soon as it has handed one over, without waiting for the caller to take it (the engine's
        rounds, so no hand-off between two steps waits on the caller's thread: 2% of a SmolLM2 step, and the
        caller turns tokens into text meanwhile). Closing this generator (or an exception in the caller while
        it waits, Ctrl-C) stops the runner before its next item and waits for it, so the models' state is whole
        when it returns; `items` is closed on the runner's thread. An exception in `items` reaches the caller."""
        if threading.current_thread() is self._thread:
            yield from items
            return
        out: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()

        def produce():
            try:
                while not stop.is_set():
                    try:
                        item = next(items)
                    except StopIteration:
                        break
                    out.put((True, item))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                out.put((False, err))
            finally:
                try:
                    items.close()
                finally:
                    out.put((None, None))

        self._submit(produce)
        ended = False
        try:
            while True:
                ok, value = out.get()
                if ok is None:
                    ended = True
                    return
                if not ok:
                    raise value
                yield value
        finally:
            stop.set()
            while not ended:  # the item in the making, then the end (a second Ctrl-C stops waiting for it)
                ended = out.get()[0] is None

    def _submit(self, fn, *args) -> threading.Lock:
        """Queue `fn(*args)` for the runner's thread; the returned lock is released when it has run."""
        self._ensure_started()
        done = threading.Lock()
        done.acquire()
        self._calls.put((fn, args, done))
        return done

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _ensure_started(self) -> None:
        with self._start_lock:
            if not self.running:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()

    @staticmethod
    def _boxed(box: list, fn, args) -> None:
        try:
            box[:] = [True, fn(*args)]
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box[:] = [False, err]

    def _serve(self) -> None:
        while True:
            fn, args, done = self._calls.get()
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a submitted function reports its own errors
                pass
            finally:
                del fn, args
                done.release()


_RUNNERS: dict[str, Runner] = {}
_RUNNERS_LOCK = threading.Lock()


def runner(name: str = "llama.cpp") -> Runner:
    """The process's runner of that name: "llama.cpp" for every model, "llama.cpp draft" for an overlapped drafter."""
    with _RUNNERS_LOCK:
        if name not in _RUNNERS:
            _RUNNERS[name] = Runner(f"edgespec-{name.replace(' ', '-').replace('.', '')}")
        return _RUNNERS[name]


def import_llama_cpp():
    """The llama_cpp module, or a one-line error saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise EdgespecError(f"the llama.cpp backend is not installed; {INSTALL_HINT}, "
                            "or use --target-backend onnx") from None
    return llama_cpp


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def check_device(name: str, *, flag: str = "--target-device") -> str:
    """The device a llama.cpp model runs on for `name`: "cpu", or "cuda"/"cuda:N" where this llama.cpp build
    offloads to a GPU (its own build decides, not torch's: a Jetson's pip torch is CPU-only while its llama.cpp
    may be a CUDA build). "auto": the GPU where the build offloads, else the CPU. An EdgespecError otherwise."""
    import re

    device = name.strip().lower()
    if device == "cpu":
        return "cpu"
    offloads = available() and build_info()["gpu_offload"]
    if device == "auto":
        return "cuda" if offloads else "cpu"
    if not re.fullmatch(r"cuda(?::\d+)?", device):
        raise EdgespecError(f"unknown device {name!r} for {flag}; use auto, cpu, cuda or cuda:N")
    if not offloads:
        raise EdgespecError(f"{flag} {device}: this llama.cpp build runs on the CPU only; reinstall it with GPU "
                            "support (CMAKE_ARGS=-DGGML_CUDA=on pip install --force-reinstall --no-cache-dir "
                            "llama-cpp-python, docs/gpu.md) or use " + flag + " cpu")
    return device


def build_info() -> dict:
    """What the installed llama.cpp was built for (for `edgespec devices`)."""
    if not available():
        return {"installed": False}
    import llama_cpp

    _init_backend(llama_cpp)
    return {"installed": True, "version": llama_cpp.__version__,
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


def _init_backend(llama_cpp) -> None:
    """Once a process: the backend, and llama.cpp's log lines silenced (errors reach the user as our own)."""
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return

        @llama_cpp.llama_log_callback
        def _quiet(level, text, user_data):  # noqa: ARG001
            pass

        _log_callback = _quiet
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True


class LlamaCppLM:
    """A GGUF model under llama.cpp with its KV cache (see the module's text). `min_rows` > 1 runs a short feed
    as that many rows (the last id repeated, the extra rows cropped away), as `OnnxLM` does for `--exact`."""

    def __init__(self, path: str | Path, *, n_ctx: int | None = None, threads: int | None = None,
                 batch_threads: int | None = None, n_batch: int = 512, device: str = "cpu", name: str = "model",
                 min_rows: int = 1, runner_name: str = "llama.cpp"):
        from .onnx_lm import default_threads

        llama_cpp = import_llama_cpp()
        _init_backend(llama_cpp)
        self._ll = llama_cpp
        path = Path(path)
        if not path.is_file():
            raise EdgespecError(f"{path} does not exist; give the path of a .gguf file")
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0 if device == "cpu" else 999
        if device.startswith("cuda:"):  # that GPU alone
            mparams.split_mode = llama_cpp.LLAMA_SPLIT_MODE_NONE
            mparams.main_gpu = int(device.split(":")[1])
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise EdgespecError(f"llama.cpp could not load {path.name} (not a GGUF file, damaged, or an architecture "
                                f"this llama.cpp build does not know); try --target-backend onnx")
        self._ctx = self._batch = None
        if llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model):
            self.close()
            raise EdgespecError(f"{path.name} is a recurrent/hybrid model, whose cache cannot be rolled back to a "
                                f"position, so it cannot verify drafts; use --no-spec or another target")
        n_train = int(llama_cpp.llama_model_n_ctx_train(self._model)) or DEFAULT_CONTEXT
        context = min(int(n_ctx), n_train) if n_ctx else min(n_train, DEFAULT_CONTEXT)
        threads = int(threads or default_threads())
        batch_threads = int(batch_threads or threads)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = context
        cparams.n_batch = cparams.n_ubatch = n_batch = min(int(n_batch), context)
        cparams.n_seq_max = 1
        cparams.n_threads, cparams.n_threads_batch = threads, batch_threads
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise EdgespecError(f"llama.cpp could not make a context of {context} tokens for {path.name} (out of "
                                f"memory?); ask for a shorter context")
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        for j in range(n_batch):  # one sequence: every slot's, once
            self._batch.n_seq_id[j] = 1
            self._batch.seq_id[j][0] = 0
        self.n_batch = n_batch
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model)))
        self.max_context = int(llama_cpp.llama_n_ctx(self._ctx))
        self.threads, self.batch_threads = threads, batch_threads
        # several threads: an OpenMP team, so the steps go to the process's long-lived llama.cpp thread
        self._runner = runner(runner_name) if max(threads, batch_threads) > 1 else None
        self.device = device
        self.path = path
        self.min_rows = int(min_rows)
        buf = ctypes.create_string_buffer(128)
        llama_cpp.llama_model_desc(self._model, buf, len(buf))
        self.model_desc = buf.value.decode(errors="replace")  # e.g. "llama ?B Q4_1"
        quant = self.model_desc.rsplit(" ", 1)[-1] if " " in self.model_desc else "gguf"
        self.description = f"llama.cpp {device} {quant}"
        self.name = name
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def reserve(self, total: int) -> None:
        """Nothing to do: the KV cache is allocated for `max_context` tokens when the model loads."""

    @property
    def runner(self) -> Runner | None:
        """The thread every step of this model runs on (None: a one-thread model, called from any thread)."""
        return self._runner

    def _call(self, fn, *args):
        return fn(*args) if self._runner is None else self._runner.call(fn, *args)

    def reset(self) -> None:
        self._call(self._reset)

    def _reset(self) -> None:
        self._ll.llama_memory_clear(self._mem, True)
        self._length = 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} tokens to {length}")
        if length < self._length:
            self._call(self._crop, length)

    def _crop(self, length: int) -> None:
        if not self._ll.llama_memory_seq_rm(self._mem, 0, length, -1):
            raise EdgespecError(f"llama.cpp could not roll its cache back to {length} tokens "
                                f"({self.model_desc}); use --no-spec with this model")
        self._length = length

    def feed(self, ids: list[int], logits_for: int) -> torch.Tensor:
        if not ids:
            return torch.empty(0, self.vocab_size)
        n = len(ids)
        check_feed(n, logits_for, self._length, self.max_context)
        if n < self.min_rows and self._length + self.min_rows <= self.max_context:
            return feed_padded(self, ids, logits_for)
        return self._call(self._feed, ids, logits_for)

    def _feed(self, ids: list[int], logits_for: int) -> torch.Tensor:
        n = len(ids)
        out = torch.empty((logits_for, self.vocab_size), dtype=torch.float32)
        first_out, got = n - logits_for, 0
        batch, row_bytes = self._batch, self.vocab_size * 4
        for start in range(0, n, self.n_batch):
            chunk = ids[start:start + self.n_batch]
            batch.n_tokens = len(chunk)
            flagged = 0
            for j, token in enumerate(chunk):  # (every slot's sequence is 0, set once in __init__)
                batch.token[j] = int(token)
                batch.pos[j] = self._length + j
                want = start + j >= first_out
                batch.logits[j] = want
                flagged += want
            rc = self._ll.llama_decode(self._ctx, batch)
            if rc != 0:
                # 1: no KV slot; < 0: an error. Tokens of a failed chunk may remain: drop them (and this feed).
                self._ll.llama_memory_seq_rm(self._mem, 0, self._length, -1)
                raise EdgespecError(f"llama.cpp could not decode {len(chunk)} tokens at position {self._length} "
                                    f"(llama_decode returned {rc}); the context may be too small")
            self._length += len(chunk)
            if flagged:  # copied: the next decode overwrites llama.cpp's buffer
                ctypes.memmove(out.data_ptr() + got * row_bytes, self._ll.llama_get_logits(self._ctx),
                               flagged * row_bytes)
                got += flagged
        return out

    def plain_generate(self, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop_ids: frozenset[int] | set[int] = frozenset()) -> tuple[list[int], float, float]:
        """llama.cpp's own decoding loop, what a user of plain llama.cpp runs: one `llama_decode` a token and
        llama.cpp's sampler chain in C (greedy; or temperature, top-k, top-p and a seeded draw), no logits copied
        out, no Python between the steps but the loop itself. The bench's anchor. Timed as the engine is: the
        prompt but its last token is the prefill, and each answer token costs one step (the first feeds the
        prompt's last token). Stops after a token in `stop_ids` (kept), at `max_new_tokens` or at the context's
        end. Returns (tokens, prefill seconds, decode seconds); starts from an empty cache and leaves the
        prompt and answer in it."""
        return self._call(self._plain_generate, list(prompt_ids), int(max_new_tokens), float(temperature),
                          int(top_k), float(top_p), seed, frozenset(stop_ids))

    def _plain_generate(self, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_ids):
        import time

        if not prompt_ids:
            raise EdgespecError("the prompt is empty; give at least one token of prompt text")
        ll = self._ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if temperature == 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        else:  # the order of edgespec.sampling: scale by 1/T, then top-k, then top-p over what is left
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(temperature))
            if top_k > 0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(top_k))
            if top_p < 1.0:
                ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(top_p, 1))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(
                ll.LLAMA_DEFAULT_SEED if seed is None else int(seed) % 2**32))
        try:
            t0 = time.perf_counter()
            self._reset()
            self._feed(prompt_ids[:-1], 0)
            t1 = time.perf_counter()
            tokens: list[int] = []
            batch, token = self._batch, prompt_ids[-1]
            batch.n_tokens, batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = 1, 1, 0, True
            while len(tokens) < max_new_tokens and self._length < self.max_context:
                batch.token[0], batch.pos[0] = token, self._length
                rc = ll.llama_decode(self._ctx, batch)
                if rc != 0:
                    raise EdgespecError(f"llama.cpp could not decode a token at position {self._length} "
                                        f"(llama_decode returned {rc})")
                self._length += 1
                token = int(ll.llama_sampler_sample(chain, self._ctx, -1))
                tokens.append(token)
                if token in stop_ids:
                    break
            return tokens, t1 - t0, time.perf_counter() - t1
        finally:
            ll.llama_sampler_free(chain)

    def close(self) -> None:
        runner_ = getattr(self, "_runner", None)
        if runner_ is not None and runner_.running:
            runner_.call(self._close)  # after any step still running on it
        else:
            self._close()

    def _close(self) -> None:
        ll = self._ll
        if getattr(self, "_batch", None) is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        if sys.is_finalizing():  # the runner thread may be frozen already; the process frees it all anyway
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process frees it anyway
            pass
