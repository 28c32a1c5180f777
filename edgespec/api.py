"""The Python API: load a pair once, then `generate`, `stream` or `chat` from any number of threads.

    import edgespec
    model = edgespec.load()                      # the embedded default pair; the CLI's model options as keywords
    print(model.chat([{"role": "user", "content": "Hi!"}]).text)
    for chunk in model.stream("Once upon a time", max_tokens=64, temperature=0.7, seed=1):
        for text, origin in chunk.pieces:        # origin: "draft" (an accepted draft) or "target"
            print(text, end="")

The device runs one request at a time (batch 1): requests from several threads wait in a line and run first
come, first served (`FairLock`). Each request can be cancelled (`Stream.cancel()`, or a `threading.Event`
passed as `cancel=`): it ends after the current round, and a request cancelled while it waits never runs.
The target's cache is kept between requests, so a request that shares a prefix with the previous one (a chat's
next turn) prefills only the part that is new. `edgespec generate`, `edgespec chat` and `edgespec serve` go
through this module.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from .errors import EdgespecError
from .metrics import SpecMetrics
from .session import DRAFT, TARGET, Chunk, Settings, encode_chat, stream_text
from .text import TextStream

__all__ = ["DRAFT", "TARGET", "Chunk", "Completion", "FairLock", "Model", "RequestError", "Stream", "load",
           "load_spec"]

DEFAULT_MAX_TOKENS = 256  # as `edgespec generate --max-new-tokens`


class RequestError(EdgespecError):
    """A bad value in one request; `param` names the field (the server's 400 says which)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class FairLock:
    """The device's line: one holder at a time, handed on in arrival order. A waiter whose `cancel` event is set
    leaves the line (it looks every `poll` seconds), so a request nobody wants any more never runs."""

    def __init__(self, poll: float = 0.05):
        self._mutex = threading.Lock()
        self._line: deque[threading.Event] = deque()
        self._held = False
        self.poll = poll

    def acquire(self, cancel: threading.Event | None = None) -> bool:
        """Wait for our turn; False (not holding) if `cancel` was set first."""
        turn = threading.Event()
        with self._mutex:
            if not self._held and not self._line:
                self._held = True
                return True
            self._line.append(turn)
        while not turn.wait(self.poll if cancel is not None else None):
            if cancel is not None and cancel.is_set():
                with self._mutex:
                    if not turn.is_set():
                        self._line.remove(turn)
                        return False
                self.release()  # handed to us as we gave up: pass it on
                return False
        return True

    def release(self) -> None:
        with self._mutex:
            if self._line:
                self._line.popleft().set()  # still held: now by the next in line
            else:
                self._held = False

    @property
    def held(self) -> bool:
        return self._held

    @property
    def waiting(self) -> int:
        return len(self._line)


@dataclass(frozen=True)
class Request:
    """One request's validated settings: `Settings` (sampling, budget, stop strings, K) and the drafter."""

    settings: Settings
    drafter: str | None = None  # None: the model's own; "none": no speculation


@dataclass
class Completion:
    """A whole answer: text, ids, why it stopped, and what speculation did for it."""

    text: str
    token_ids: list[int]
    stop_reason: str | None
    prompt_tokens: int
    cached_tokens: int  # of the prompt, already in the target's cache from the previous request (at least this)
    metrics: SpecMetrics
    pieces: list[tuple[str, str]]
    drafter: str  # what drafted ("none": the target alone)
    k: int | str  # the K asked for: a number or "auto"
    queue_s: float  # waiting for the device
    speedup: float | None = None  # decode tokens/s over the last plain (K = 0) request's, once one has run

    @property
    def notices(self) -> list[str]:
        return self.metrics.notices

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": list(self.token_ids), "stop_reason": self.stop_reason,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "drafter": self.drafter,
                "k": self.k, "queue_s": self.queue_s, "speedup": self.speedup, "notices": list(self.notices),
                "metrics": self.metrics.to_dict()}


class Stream:
    """One request as it runs: iterate it for `Chunk`s (text pieces tagged "draft"/"target", the ids of the
    round, K, the running metrics, a notice, and the stop reason on the last one). It waits for the device on
    the first `next()`. `cancel()` (from any thread) ends it after the current round; `close()` (or leaving a
    `with` block) ends it at once and frees the device for the next request."""

    def __init__(self, model: Model, prompt_ids: list[int], request: Request, cancel: threading.Event | None):
        self.model = model
        self.prompt_ids = prompt_ids
        self.request = request
        self.cancel_event = cancel if cancel is not None else threading.Event()
        self.token_ids: list[int] = []
        self.pieces: list[tuple[str, str]] = []
        self.metrics = SpecMetrics()
        self.stop_reason: str | None = None
        self.cached_tokens = 0
        self.queue_s = 0.0
        self.drafter = "none"
        self.started = threading.Event()  # set once it holds the device (or gave up its place)
        self._text = TextStream(model.tokenizer, request.settings.stop)
        self._steps = model._run(self)

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        return next(self._steps)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cancel(self) -> None:
        self.cancel_event.set()

    def close(self) -> None:
        self._steps.close()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def text(self) -> str:
        """The text so far (after an interruption, including a tail not yet handed out as a piece)."""
        return self._text.text

    def result(self) -> Completion:
        """The answer as it stands (call after the last chunk for the whole of it)."""
        speedup = None
        plain = self.model.plain_tokens_per_s
        if plain and self.metrics.num_drafts and self.metrics.decode_tokens_per_s > 0:
            speedup = self.metrics.decode_tokens_per_s / plain
        return Completion(self._text.text, list(self.token_ids), self.stop_reason, self.prompt_tokens,
                          self.cached_tokens, self.metrics, list(self.pieces), self.drafter, self.request.settings.k,
                          self.queue_s, speedup)


class Model:
    """A loaded pair (`load`), shared by every thread; see the module's docstring."""

    def __init__(self, runtime, *, k: int | str = "auto", temperature: float = 0.0, p_min: float | None = None,
                 profile=None, name: str | None = None):
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.k = k
        self.temperature = temperature
        self.p_min = p_min
        self.profile = profile
        self.name = name or runtime.pair or "model"
        self.plain_tokens_per_s: float | None = None  # the last plain (K = 0) request's decode speed
        self._lock = FairLock()
        self._engines = {runtime.drafter_name if runtime.engine.drafter is not None else "none": runtime.engine}
        self._policies: dict[tuple[str, str], object] = {}
        self._cached: list[int] = []  # what the target's cache holds after the last request (a prefix of it)
        self._encoding = threading.Lock()  # one encode at a time: a fast tokenizer may reconfigure itself to encode

    # ---- what it is

    @property
    def max_context(self) -> int:
        return self.runtime.engine.target.max_context

    @property
    def drafter(self) -> str:
        """The drafter requests use unless they name another ("none" without one)."""
        return self.runtime.drafter_name if self.runtime.engine.drafter is not None else "none"

    @property
    def description(self) -> dict:
        return {"target": self.runtime.target_description, "draft": self.runtime.draft_description,
                "drafter": self.drafter, "k": self.k, "overlap": self.runtime.engine.overlap}

    def limit_context(self, tokens: int) -> None:
        """Let requests use at most `tokens` of the context (prompt and answer together) from now on: a longer
        prompt is refused and an answer that reaches it stops with reason "context". It only lowers the model's
        own limit (`max_context`), and waits its turn for the device, so no request runs under two limits.
        `scripts/soak.py --context` uses it to reach a chat's context end in fewer tokens."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
            raise RequestError(f"a context limit of {tokens!r} tokens is too small; give at least 2 (a prompt token "
                               "and an answer's)", "max_context")
        self._lock.acquire()
        try:
            target = self.runtime.engine.target  # the extra drafters' engines share it (`_engine_for`)
            target.max_context = min(tokens, target.max_context)
        finally:
            self._lock.release()

    @property
    def has_chat_template(self) -> bool:
        """The tokenizer has a chat template, which `chat` needs (an instruct/chat model); without one, prompt
        with raw text (`generate`/`stream`)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def busy(self) -> bool:
        """A request holds the device."""
        return self._lock.held

    @property
    def waiting(self) -> int:
        """Requests in line for the device."""
        return self._lock.waiting

    # ---- prompts

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A raw prompt (no chat template; special tokens as the tokenizer adds them), or token ids as they are."""
        if isinstance(prompt, str):
            with self._encoding:
                return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        ids = list(prompt)
        vocab = self.runtime.engine.target.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be integers from 0 to {vocab - 1}", "prompt")
        return ids

    def encode_chat(self, messages: list[dict], system: str | None = None, *,
                    missing: str = "use a raw prompt instead") -> list[int]:
        """`messages` through the model's own chat template (the same as `edgespec chat`)."""
        with self._encoding:
            return encode_chat(self.tokenizer, messages, system, missing=missing)

    # ---- requests

    def request(self, *, max_tokens: int | None = DEFAULT_MAX_TOKENS, temperature: float | None = None,
                top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] = (),
                k: int | str | None = None, speculation: bool = True, drafter: str | None = None) -> Request:
        """Validate one request's settings (RequestError naming the field). `max_tokens` None: up to the context's
        end; `temperature` None: the model's (0 = greedy by default); `k` None: the model's (`load(k=...)`)."""
        return Request(check_settings(self, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, seed=seed, stop=stop, k=k, speculation=speculation),
                       check_drafter(drafter))

    def stream(self, prompt: str | Sequence[int], *, cancel: threading.Event | None = None,
               request: Request | None = None, **settings) -> Stream:
        """Stream the continuation of `prompt` (raw text or token ids); `settings` as `request()` takes them."""
        ids = self.encode(prompt)
        self.check_prompt(ids)
        return Stream(self, ids, request or self.request(**settings), cancel)

    def generate(self, prompt: str | Sequence[int], *, cancel: threading.Event | None = None, **settings) -> Completion:
        """The whole continuation of `prompt`."""
        return _drain(self.stream(prompt, cancel=cancel, **settings))

    def chat(self, messages: list[dict], *, system: str | None = None, stream: bool = False,
             cancel: threading.Event | None = None, **settings) -> Completion | Stream:
        """The assistant's answer to `messages` (OpenAI-style role/content dicts) under the model's chat template."""
        s = self.stream(self.encode_chat(messages, system), cancel=cancel, **settings)
        return s if stream else _drain(s)

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        if not ids:
            raise RequestError("the prompt is empty; give at least one token of prompt text", param)
        if len(ids) >= self.max_context:
            raise RequestError(f"the prompt has {len(ids)} tokens but the model's context holds {self.max_context}; "
                               "shorten the prompt (or the chat history)", param)

    # ---- running (one request at a time)

    def _run(self, s: Stream) -> Iterator[Chunk]:
        t0 = time.perf_counter()
        if not self._lock.acquire(s.cancel_event):
            yield self._gave_up(s, t0)
            return
        try:
            s.queue_s = time.perf_counter() - t0
            s.started.set()
            if s.cancel_event.is_set():
                yield self._gave_up(s, t0)
                return
            yield from self._generate(s)
        finally:
            s.started.set()
            self._lock.release()

    def _generate(self, s: Stream) -> Iterator[Chunk]:
        """Run `s` on the engine (holding the device)."""
        engine, s.drafter = self._engine_for(s.request)
        settings = s.request.settings
        budget = settings.max_new_tokens or max(self.max_context - len(s.prompt_ids), 1)
        settings = settings.with_(max_new_tokens=budget)
        policy = self._policy_for(engine, s.drafter, settings)
        s.cached_tokens = _common_prefix(self._cached, s.prompt_ids[:-1])
        self._cached = []  # unknown until the request ends between rounds
        between_rounds = clean = False
        try:
            with contextlib.closing(stream_text(engine, self.tokenizer, s.prompt_ids, settings, policy,
                                                cancel=s.cancel_event, metrics=s.metrics, text=s._text)) as chunks:
                for chunk in chunks:
                    s.token_ids.extend(chunk.token_ids)
                    s.pieces.extend(chunk.pieces)
                    s.stop_reason = chunk.stop_reason
                    between_rounds = True
                    yield chunk
                    between_rounds = False
            clean = True
            self._note_speed(s)
        except Exception:
            s.stop_reason = "error"
            raise
        finally:
            if s.stop_reason is None:  # closed or interrupted (Ctrl-C) before its end
                s.stop_reason = "cancelled"
            if clean or between_rounds:
                # the target's cache holds the prompt and the answer but its last token (and maybe more)
                self._cached = (s.prompt_ids + s.token_ids)[:-1]

    def _gave_up(self, s: Stream, t0: float) -> Chunk:
        s.queue_s = time.perf_counter() - t0
        s.stop_reason = "cancelled"
        s.started.set()
        return Chunk([], 0, s.metrics, "cancelled")

    def _note_speed(self, s: Stream) -> None:
        m = s.metrics
        if not any(m.k_per_round) and m.num_emitted_tokens >= 8 and m.decode_tokens_per_s > 0:
            self.plain_tokens_per_s = m.decode_tokens_per_s

    def _engine_for(self, request: Request):
        """The engine for this request's drafter (extra ones share the target, so its cache carries over)."""
        from . import runtime as rt_module
        from .engine import SpeculativeEngine

        settings = request.settings
        name = request.drafter or self.drafter
        if not settings.speculation or settings.k == 0:
            name = "none"
        if name not in self._engines:
            rt = self.runtime
            drafter = None
            if name != "none":
                drafter = rt_module.extra_drafter(rt, name)
                if drafter is None:
                    raise RequestError(f"drafter {name!r} needs a draft model and this target has none; use ngram, "
                                       "none, or load a pair", "drafter")
            self._engines[name] = SpeculativeEngine(rt.engine.target, drafter, eos_token_ids=rt.engine.eos_token_ids,
                                                    overlap=rt.engine.overlap)
        return self._engines[name], name

    def _policy_for(self, engine, drafter: str, settings: Settings):
        from .policy import FixedK
        from .runtime import make_policy

        if engine.drafter is None:
            return FixedK(0)
        if settings.k != "auto":
            return make_policy(settings.k, None, drafter, settings.temperature, p_min=self.p_min)
        band = "greedy" if settings.temperature == 0 else "sampling"
        key = (drafter, band)  # one adaptive policy per drafter and band, kept: what it learnt carries over
        if key not in self._policies:
            self._policies[key] = make_policy("auto", self.profile, drafter, settings.temperature,
                                              overlap=engine.overlap, p_min=self.p_min)
        return self._policies[key]


def _drain(s: Stream) -> Completion:
    with s:
        for _ in s:
            pass
    return s.result()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _number(value, param: str, *, integer: bool = False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (not integer and not math.isfinite(value)):
        raise RequestError(f"{param} must be {'an integer' if integer else 'a number'}, not {value!r}", param)
    return value


def check_settings(model: Model, *, max_tokens, temperature, top_p, top_k, seed, stop, k, speculation) -> Settings:
    """Every per-request value, with a one-line error naming the field."""
    from .cli import MAX_SEED
    from .policy import MAX_K

    if max_tokens is not None and _number(max_tokens, "max_tokens", integer=True) < 1:
        raise RequestError(f"max_tokens={max_tokens} must be at least 1", "max_tokens")
    temperature = model.temperature if temperature is None else temperature
    if _number(temperature, "temperature") < 0:
        raise RequestError(f"temperature={temperature} is negative; use 0 (greedy) or a positive number", "temperature")
    if not 0 < _number(top_p, "top_p") <= 1:
        raise RequestError(f"top_p={top_p} is outside (0, 1]; use 1 to turn it off", "top_p")
    if _number(top_k, "top_k", integer=True) < 0:
        raise RequestError(f"top_k={top_k} is negative; use 0 to turn it off", "top_k")
    if seed is not None and not 0 <= _number(seed, "seed", integer=True) <= MAX_SEED:
        raise RequestError(f"seed={seed} is out of range; use a whole number from 0 to {MAX_SEED}", "seed")
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings", "stop")
    k = model.k if k is None else k
    if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_K):
        raise RequestError(f"k={k!r} is out of range; use \"auto\" or an integer from 0 (no speculation) to {MAX_K}",
                           "k")
    if not isinstance(speculation, bool):
        raise RequestError(f"speculation must be true or false, not {speculation!r}", "speculation")
    return Settings(temperature=float(temperature), top_p=float(top_p), top_k=top_k, max_new_tokens=max_tokens,
                    k=k, speculation=speculation, seed=seed, stop=tuple(stop))


def check_drafter(name: str | None) -> str | None:
    from .runtime import DRAFTERS

    if name is not None and name not in DRAFTERS:
        raise RequestError(f"drafter={name!r} is not one of {', '.join(DRAFTERS)}", "drafter")
    return name


def load(pair: str | None = None, target: str | None = None, draft: str | None = None, *, k: int | str = "auto",
         temperature: float = 0.0, p_min: float | None = None, profile: str | None = None,
         progress: Callable[[str], None] | None = None, name: str | None = None, **options) -> Model:
    """Load a pair (default: the embedded one) or a target (and draft) as `edgespec generate` would. `options`:
    the rest of the CLI's model options (`runtime.RuntimeSpec`'s fields: target_backend, target_device,
    draft_backend, draft_device, dtype, threads, draft_threads, overlap, exact). `k` and `temperature` are the
    requests' defaults ("auto" picks the drafter and K from this machine's profile); `progress` gets the
    loading's progress lines (default: stderr)."""
    from .runtime import RuntimeSpec

    known = {f.name for f in fields(RuntimeSpec)} - {"pair", "target", "draft"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise EdgespecError(f"unknown option(s) {', '.join(unknown)}; use {', '.join(sorted(known))}")
    spec = RuntimeSpec(pair=pair, target=target, draft=draft, **options)
    return load_spec(spec, k=k, temperature=temperature, p_min=p_min, profile=profile, progress=progress, name=name)


def load_spec(spec, *, k: int | str = "auto", temperature: float = 0.0, p_min: float | None = None,
              profile: str | None = None, progress: Callable[[str], None] | None = None,
              name: str | None = None) -> Model:
    """`load` from a `RuntimeSpec` (the CLI builds one from its arguments)."""
    from . import runtime
    from .policy import check_k, parse_p_min
    from .progress import reporting_to

    if k != "auto":
        try:
            k = check_k(k)
        except EdgespecError:
            raise EdgespecError(f"k={k!r} is out of range; use auto or an integer from 0 to 16") from None
    p_min = parse_p_min(p_min)
    chosen = None
    if k == "auto":  # the profile's drafter (and overlap) for this machine, or a warning that K calibrates online
        with reporting_to(progress) if progress is not None else contextlib.nullcontext():
            chosen = runtime.select_profile(spec, profile, temperature)
    rt = runtime.build_runtime(spec, progress)
    if name is None and rt.pair is None and spec.target is not None:
        name = Path(spec.target).name
    return Model(rt, k=k, temperature=temperature, p_min=p_min, profile=chosen, name=name)
