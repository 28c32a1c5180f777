"""`edgespec serve`: the OpenAI-compatible HTTP API over one loaded pair (what llama.cpp's server, Ollama, LM
Studio and vLLM speak), so any OpenAI client (a voice front end, an IDE plugin, Open WebUI, a script) can use it.

The HTTP side (Starlette on uvicorn) only validates, encodes and formats: each request becomes a `Stream` of the
Python API (`edgespec.api`) run on a thread of its own, which waits for the device in the API's first-come line.
Admitted requests are bounded (one running, `max_queue` waiting; past that 429 with Retry-After). A client that
goes away cancels its request at the next round (or takes it out of the line). SIGTERM/SIGINT cancel everything
in flight: each stream still ends with a final chunk and `data: [DONE]`. See docs/serve.md.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

from .api import Completion, Model, RequestError, Stream
from .session import Chunk
from .errors import EdgespecError

DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_BODY = 4 * 2**20  # bytes: a chat history filling an 8k context is ~50 kB
# Rounds that finish within this long of the last event go out together in the next (the first text, notices and
# the last round at once): an event per round cost one streaming client 8% of its tokens/s on 2 cores, where the
# server's loop and the client take CPU from llama.cpp's two threads (docs/serve.md, 2026-12-07)
DEFAULT_STREAM_INTERVAL_MS = 50.0
DRAIN_LIMIT = 64 * 2**20  # a too-large body up to this is read and dropped, so the client sees the 413
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # anything else: "abort"
log = logging.getLogger("uvicorn.error")


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self):
        from starlette.responses import JSONResponse

        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable"}.get(self.status)
        kind = kind or ("invalid_request_error" if self.status < 500 else "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}},
                            status_code=self.status, headers=self.headers)


# ---- request bodies (pydantic, strict: "10" is not a number)

def _schemas():
    """The request models, built on first use (pydantic is imported only by the server)."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class Base(BaseModel):
        model_config = ConfigDict(strict=True, extra="ignore")

    class Extension(Base):
        speculation: bool = True
        k: int | Literal["auto"] | None = None
        drafter: str | None = None
        origins: bool = False  # streamed chunks carry their text's origin (draft / target)

    class StreamOptions(Base):
        include_usage: bool = False

    class Common(Base):
        model: str | None = None
        max_tokens: int | None = None
        max_completion_tokens: int | None = None
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None
        seed: int | None = None
        stop: str | list[str] | None = None
        n: int | None = None
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        logprobs: bool | int | None = None
        edgespec: Extension = Field(default_factory=Extension)

    class Part(BaseModel):
        model_config = ConfigDict(strict=True, extra="ignore")
        type: str
        text: str | None = None

    class Message(Base):
        role: str
        content: str | list[Part] | None = None

    class Chat(Common):
        messages: list[Message] = Field(min_length=1)

    class Completions(Common):
        prompt: str | list[str] | list[int]
        echo: bool | None = None
        suffix: str | None = None
        best_of: int | None = None

    return Chat, Completions


_SCHEMAS = None


def parse(kind: str, body: dict):
    """The body as the request model of `kind` ("chat" / "completions"); 400 naming the first bad field."""
    from pydantic import ValidationError

    global _SCHEMAS
    if _SCHEMAS is None:
        _SCHEMAS = _schemas()
    schema = _SCHEMAS[0] if kind == "chat" else _SCHEMAS[1]
    try:
        return schema.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = _param(first["loc"])
        if first["type"] == "missing":
            raise ApiError(400, f"{param} is required", param) from None
        raise ApiError(400, f"{param}: {first['msg']}", param) from None


def _param(loc) -> str:
    """A pydantic error location as a field path (messages.0.content), without its union-member tags."""
    parts = [str(p) for p in loc if isinstance(p, int) or (p[:1].islower() and "[" not in p and p not in
                                                           ("str", "int", "float", "bool", "literal", "none"))]
    return ".".join(parts) or "body"


# ---- bookkeeping and Prometheus metrics

class Metrics:
    """The server's counters, named as vLLM's (`vllm:spec_decode_*`, `vllm:time_to_first_token_seconds`, ...)."""

    def __init__(self, model: Model):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        p = "edgespec:"
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Rounds in which tokens were drafted", registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.requests = Counter(p + "request_success", "Requests finished, by finish reason (abort: cancelled, "
                                "the client went away, or shutdown)", ["finished_reason"], registry=r)
        self.rejected = Counter(p + "request_rejected", "Requests refused before running, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(p + "prompt_tokens_cached", "Prompt tokens found in the target's cache",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        latency = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From arrival to the first generated token",
                              buckets=latency, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time per generated token after the first "
                             "(a round's time over the tokens it emitted)",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                                      1, 2.5), registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "From arrival to the last token", buckets=latency,
                             registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Waiting for the device", buckets=latency,
                                    registry=r)
        Gauge(p + "num_requests_running", "Requests on the device", registry=r).set_function(lambda: int(model.busy))
        Gauge(p + "num_requests_waiting", "Requests in line for the device", registry=r).set_function(
            lambda: model.waiting)
        self._recent: list[float] = []  # the last requests' durations, for Retry-After

    def finished(self, job: Job) -> None:
        """Count a request that ended (in any way) on its own thread."""
        s, m = job.stream, job.stream.metrics
        self.requests.labels(finished_reason=job.finish_reason()).inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.cached_tokens.inc(s.cached_tokens)
        self.generation_tokens.inc(m.num_emitted_tokens)
        self.num_drafts.inc(m.num_drafts)
        self.num_draft_tokens.inc(m.num_draft_tokens)
        self.num_accepted_tokens.inc(m.num_accepted_tokens)
        for i, n in enumerate(m.accepted_per_position):
            self.accepted_per_pos.labels(position=str(i)).inc(n)
        if s.started.is_set():
            self.queue_time.observe(s.queue_s)
        end = job.last_token_at or time.perf_counter()
        self.e2e.observe(end - job.arrived)
        self._recent = [*self._recent[-15:], end - job.arrived]

    def retry_after(self, waiting: int) -> int:
        """Seconds until a place in the line is likely free: the recent mean request time times the line."""
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, math.ceil(mean * max(waiting, 1)))


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """Several rounds' chunks as one (the last one's K, metrics and stop reason; every piece, id and notice)."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    notices = [c.notice for c in chunks if c.notice]
    return Chunk(pieces=[p for c in chunks for p in c.pieces], k=last.k, metrics=last.metrics,
                 stop_reason=last.stop_reason, token_ids=[t for c in chunks for t in c.token_ids],
                 notice="; ".join(notices) if notices else None)


@dataclass(eq=False)
class Job:
    """One admitted request between the HTTP side (asyncio) and its generation (a thread of its own)."""

    server: Server
    stream: Stream
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)  # when the HTTP request came in
    first_token_at: float | None = None
    last_token_at: float | None = None
    ended_by: str | None = None  # "disconnected" / "shutdown": why it was cancelled
    error: BaseException | None = None

    def start(self) -> None:
        threading.Thread(target=self._run, name="edgespec-request", daemon=True).start()

    def cancel(self, why: str) -> None:
        if self.ended_by is None:
            self.ended_by = why
        self.stream.cancel()

    def finish_reason(self) -> str:
        if self.error is not None:
            return "error"
        return FINISH.get(self.stream.stop_reason, "abort")

    def _run(self) -> None:
        metrics = self.server.metrics
        interval = self.server.stream_interval
        pending: list = []  # rounds not yet handed to the event loop (see Server.stream_interval)
        posted, posted_text = -math.inf, False
        try:
            last = None
            for chunk in self.stream:
                now = time.perf_counter()
                if chunk.token_ids:
                    if self.first_token_at is None:
                        self.first_token_at = now
                        metrics.ttft.observe(now - self.arrived)
                    elif last is not None:
                        for _ in chunk.token_ids:
                            metrics.itl.observe((now - last) / len(chunk.token_ids))
                    last = self.last_token_at = now
                pending.append(chunk)
                # the first text goes out at once (time to first token), and so do notices and the last round
                if now - posted >= interval or not posted_text or chunk.notice or chunk.stop_reason:
                    merged = merge_chunks(pending)
                    self._put(("chunk", merged))
                    pending, posted, posted_text = [], now, posted_text or bool(merged.text)
            last_event = ("end", None)
        except Exception as err:  # noqa: BLE001 - reported to the client as an error response, logged here
            self.error = err
            if not isinstance(err, EdgespecError):
                log.exception("edgespec: request failed")
            last_event = ("error", err)
        finally:
            if pending:
                self._put(("chunk", merge_chunks(pending)))
            # counted and out of the admitted set before the client can see its answer end
            self.stream.close()
            metrics.finished(self)
            self.server.release(self)
        self._put(last_event)

    def _put(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (the server stopped): nobody is listening
            pass


class Server:
    """The app's state: the model, the admitted jobs, the metrics, the limits."""

    def __init__(self, model: Model, *, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
                 max_body: int = DEFAULT_MAX_BODY, temperature: float = 1.0,
                 stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS):
        self.model = model
        # Rounds that finish within this long of the last event sent go out together in the next one: each
        # event costs the server and the client CPU time that, on a small machine, the model's threads lose.
        self.stream_interval = stream_interval_ms / 1000
        self.api_key = api_key
        self.max_queue = max_queue
        self.max_body = max_body
        self.temperature = temperature  # for requests that send none (OpenAI's default is 1)
        self.metrics = Metrics(model)
        self.jobs: set[Job] = set()
        self._jobs_lock = threading.Lock()
        self.closing = False
        self.created = int(time.time())

    # ---- admission

    def admit(self, stream: Stream, arrived: float) -> Job:
        if self.closing:
            self.metrics.rejected.labels(status="503").inc()
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        with self._jobs_lock:
            if len(self.jobs) >= self.max_queue + 1:
                self.metrics.rejected.labels(status="429").inc()
                wait = self.metrics.retry_after(len(self.jobs))
                raise ApiError(429, f"{len(self.jobs)} requests are running or waiting (the limit is one running "
                               f"and --max-queue {self.max_queue} waiting); retry in {wait} s",
                               code="queue_full", headers={"Retry-After": str(wait)})
            job = Job(self, stream, asyncio.get_running_loop(), arrived=arrived)
            self.jobs.add(job)
        job.start()
        return job

    def release(self, job: Job) -> None:
        with self._jobs_lock:
            self.jobs.discard(job)

    def shutdown(self) -> None:
        """SIGTERM/SIGINT: take no new requests, end every admitted one at its next round."""
        self.closing = True
        with self._jobs_lock:
            jobs = list(self.jobs)
        for job in jobs:
            job.cancel("shutdown")

    # ---- encoding (on a worker thread: a long prompt does not hold up the event loop)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.model.encode_chat(messages, missing="use /v1/completions with a raw prompt")

    def encode(self, prompt: str) -> list[int]:
        return self.model.encode(prompt)


# ---- the endpoints

async def read_json(request, limit: int) -> dict:
    """The body as a JSON object: 413 past `limit` bytes, 400 for anything but a JSON object."""
    length = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is over {limit} bytes, the limit (edgespec serve --max-body)",
                       code="request_too_large")
    if length is not None and length.isdigit() and int(length) > DRAIN_LIMIT:
        raise too_big
    body, total = bytearray(), 0
    async for part in request.stream():
        total += len(part)
        if total > DRAIN_LIMIT:
            raise too_big
        if total <= limit:
            body += part
    if total > limit:
        raise too_big
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the body is not valid JSON ({err})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return data


def _messages(req) -> list[dict]:
    """OpenAI messages as the chat template takes them: text content only ("developer" is a system prompt)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise ApiError(400, "only text content parts are supported", f"messages.{i}.content")
            content = "".join(p.text for p in content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out


def _check_common(server: Server, req) -> None:
    name = server.model.name
    if req.model is not None and req.model != name:
        raise ApiError(400, f"model {req.model!r} is not served here; this server serves {name!r} (GET /v1/models)",
                       "model", code="model_not_found")
    if req.n not in (None, 1):
        raise ApiError(400, f"n={req.n}: one choice per request only; send n=1 or leave it out", "n")
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported; leave them out", "logprobs")


def _settings(server: Server, req):
    """The request's sampling settings and speculation controls, validated by the API (400 naming the field)."""
    ext = req.edgespec
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    try:
        return server.model.request(
            max_tokens=max_tokens, temperature=server.temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=0 if req.top_k in (None, -1) else req.top_k,
            seed=req.seed, stop=req.stop or (), k=ext.k, speculation=ext.speculation, drafter=ext.drafter)
    except RequestError as err:
        param = err.param
        if param in ("k", "drafter", "speculation"):
            param = f"edgespec.{param}"
        elif param == "max_tokens" and req.max_completion_tokens is not None:
            param = "max_completion_tokens"
        raise ApiError(400, str(err), param) from None


async def _encode(server: Server, fn, arg, param: str, *, check: bool = True) -> list[int]:
    from starlette.concurrency import run_in_threadpool

    try:
        ids = await run_in_threadpool(fn, arg)
    except EdgespecError as err:
        raise ApiError(400, str(err), param) from None
    except Exception as err:  # noqa: BLE001 - the model's template refusing these messages (jinja2 raise_exception)
        raise ApiError(400, f"the model's chat template refused these messages: {err}", param) from None
    if not check:
        return ids
    try:
        server.model.check_prompt(ids, param)
    except RequestError as err:
        raise ApiError(400, str(err), param, code="context_length_exceeded" if ids else None) from None
    return ids


async def chat_completions(request):
    arrived = time.perf_counter()
    server: Server = request.app.state.server
    req = parse("chat", await read_json(request, server.max_body))
    _check_common(server, req)
    settings = _settings(server, req)
    ids = await _encode(server, server.encode_chat, _messages(req), "messages")
    return await _respond(request, server, req, ids, settings, "chat", arrived)


async def completions(request):
    arrived = time.perf_counter()
    server: Server = request.app.state.server
    req = parse("completions", await read_json(request, server.max_body))
    _check_common(server, req)
    if req.echo:
        raise ApiError(400, "echo is not supported; leave it out", "echo")
    if req.suffix:
        raise ApiError(400, "suffix (fill in the middle) is not supported; leave it out", "suffix")
    if req.best_of not in (None, 1):
        raise ApiError(400, f"best_of={req.best_of}: one choice per request only", "best_of")
    settings = _settings(server, req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, f"{len(prompt)} prompts in one request; send one (the server runs batch 1)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await _encode(server, server.encode, prompt, "prompt")
    else:
        try:
            ids = server.model.encode(prompt)
            server.model.check_prompt(ids)
        except RequestError as err:
            raise ApiError(400, str(err), "prompt") from None
    return await _respond(request, server, req, ids, settings, "completions", arrived)


async def _respond(request, server: Server, req, ids: list[int], settings, kind: str, arrived: float):
    """Admit the request, wait for its first round, then answer: an event stream, or the whole JSON body."""
    from starlette.responses import JSONResponse

    stream = Stream(server.model, ids, settings, None)
    job = server.admit(stream, arrived)
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    streaming = False
    try:
        fmt = Format(server, req, kind, job)
        first = await job.events.get()  # the headers go out with the first round: errors before it are HTTP errors
        if first[0] == "error":
            raise _error_for(first[1])
        if req.stream:
            def closed(complete: bool) -> None:
                watcher.cancel()
                if not complete:  # the client went away mid-stream
                    job.cancel("disconnected")

            streaming = True
            return EventStream(fmt.events(first), on_close=closed)
        event = first
        while event[0] == "chunk":
            event = await job.events.get()
        if event[0] == "error":
            raise _error_for(event[1])
        return JSONResponse(fmt.whole(stream.result()))
    except asyncio.CancelledError:
        job.cancel("disconnected")
        raise
    finally:
        if not streaming:  # the event stream stops watching when it ends
            watcher.cancel()


def _error_for(err: BaseException) -> ApiError:
    if isinstance(err, RequestError):
        param = f"edgespec.{err.param}" if err.param in ("k", "drafter", "speculation") else err.param
        return ApiError(400, str(err), param)
    if isinstance(err, EdgespecError):
        return ApiError(500, str(err), code="generation_failed")
    return ApiError(500, "the request failed inside the server; its log has the details", code="internal_error")


async def _watch_disconnect(request, job: Job) -> None:
    """Cancel `job` if the client goes away before its response is complete."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel("disconnected")
            return


class EventStream:
    """A server-sent-events response from an async iterator of bytes; `on_close(complete)` runs however it ends."""

    def __init__(self, events, on_close):
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        complete = False
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            complete = True
        except OSError:  # the client went away mid-send
            pass
        finally:
            self.on_close(complete)


class Format:
    """OpenAI's response and chunk shapes for one request, with llama.cpp's `timings` and an `edgespec` block."""

    def __init__(self, server: Server, req, kind: str, job: Job):
        self.server, self.req, self.kind, self.job = server, req, kind, job
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def _envelope(self, choices: list, chunk: bool) -> dict:
        obj = "text_completion" if self.kind != "chat" else "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.model.name,
                "choices": choices}

    def _choice(self, text: str | None, finish: str | None, *, delta: dict | None = None) -> dict:
        if self.kind == "chat":
            body = {"delta": delta if delta is not None else ({"content": text} if text else {})}
        else:
            body = {"text": text or ""}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}

    def whole(self, c: Completion) -> dict:
        finish = self.job.finish_reason()
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": finish}
        return {**self._envelope([choice], False), "usage": usage(c), "timings": timings(c),
                "edgespec": self.block(c)}

    async def events(self, first):
        """The SSE body: a role chunk (chat), a chunk per round with text, the final chunk, usage, [DONE]."""
        event = first
        if self.kind == "chat":
            role = self._choice(None, None, delta={"role": "assistant", "content": ""})
            yield self._sse(self._envelope([role], True))
        while True:
            if event[0] == "chunk":
                chunk = event[1]
                if chunk.text or chunk.notice:
                    out = self._envelope([self._choice(chunk.text, None)], True)
                    ext = {}
                    if self.req.edgespec.origins and chunk.pieces:
                        ext["origins"] = [[t, o] for t, o in chunk.pieces]
                    if chunk.notice:
                        ext["notice"] = chunk.notice
                    if ext:
                        out["edgespec"] = ext
                    yield self._sse(out)
            else:
                break
            event = await self.job.events.get()
        c = self.job.stream.result()
        if event[0] == "error":  # mid-stream: OpenAI's streams carry an error object
            err = _error_for(event[1])
            yield self._sse({"error": {"message": err.message, "type": "server_error", "param": err.param,
                                       "code": err.code}})
        final = self._envelope([self._choice(None, self.job.finish_reason())], True)
        final["timings"] = timings(c)
        final["edgespec"] = self.block(c)
        yield self._sse(final)
        if self.include_usage:
            yield self._sse({**self._envelope([], True), "usage": usage(c)})
        yield b"data: [DONE]\n\n"

    def _sse(self, obj: dict) -> bytes:
        if self.include_usage and "usage" not in obj:
            obj["usage"] = None
        return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def block(self, c: Completion) -> dict:
        m, job = c.metrics, self.job
        return {
            "drafter": c.drafter, "k": c.k, "k_per_round": list(m.k_per_round), "tau": m.tau,
            "acceptance_rate": m.acceptance_rate, "acceptance_per_position": m.acceptance_per_position(),
            "num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens,
            "num_accepted_tokens": m.num_accepted_tokens, "speedup": c.speedup,
            "stop_reason": job.ended_by if c.stop_reason == "cancelled" and job.ended_by else c.stop_reason,
            "notices": list(c.notices), "queue_ms": c.queue_s * 1000,
            "ttft_ms": (job.first_token_at - job.arrived) * 1000 if job.first_token_at else None,
            "decode_tokens_per_s": m.decode_tokens_per_s,
        }


def usage(c: Completion) -> dict:
    m = c.metrics
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": m.num_emitted_tokens,
            "total_tokens": c.prompt_tokens + m.num_emitted_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": m.num_accepted_tokens,
                                          "rejected_prediction_tokens": m.num_draft_tokens - m.num_accepted_tokens}}


def timings(c: Completion) -> dict:
    """llama.cpp server's `timings` block."""
    m = c.metrics
    prompt_n = max(c.prompt_tokens - c.cached_tokens, 0)
    predicted_ms = max(m.wall_s * 1000 - m.prefill_ms, 0.0)
    return {"cache_n": c.cached_tokens, "prompt_n": prompt_n, "prompt_ms": m.prefill_ms,
            "prompt_per_token_ms": m.prefill_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": prompt_n / m.prefill_ms * 1000 if m.prefill_ms > 0 else 0.0,
            "predicted_n": m.num_emitted_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / m.num_emitted_tokens if m.num_emitted_tokens else 0.0,
            "predicted_per_second": m.decode_tokens_per_s,
            "draft_n": m.num_draft_tokens, "draft_n_accepted": m.num_accepted_tokens}


async def tokenize(request):
    """vLLM's (and llama.cpp's) POST /tokenize: a prompt's or chat's token ids under the served model."""
    server: Server = request.app.state.server
    body = await read_json(request, server.max_body)
    if "messages" in body:
        req = parse("chat", body)
        ids = await _encode(server, server.encode_chat, _messages(req), "messages", check=False)
    elif isinstance(body.get("prompt"), str):
        ids = await _encode(server, server.encode, body["prompt"], "prompt", check=False)
    else:
        raise ApiError(400, "send a prompt (a string) or messages", "prompt")
    return _json({"tokens": ids, "count": len(ids), "max_model_len": server.model.max_context})


async def models(request):
    server: Server = request.app.state.server
    model = server.model
    return _json({"object": "list", "data": [{"id": model.name, "object": "model", "created": server.created,
                                              "owned_by": "edgespec", "max_model_len": model.max_context,
                                              "edgespec": model.description}]})


async def health(request):
    server: Server = request.app.state.server
    status = "shutting_down" if server.closing else "ok"
    return _json({"status": status, "model": server.model.name, "running": int(server.model.busy),
                  "waiting": server.model.waiting}, 503 if server.closing else 200)


async def metrics(request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.responses import Response

    server: Server = request.app.state.server
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _json(obj, status: int = 200):
    from starlette.responses import JSONResponse

    return JSONResponse(obj, status_code=status)


class Auth:
    """Pure ASGI middleware: with an API key, every path but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if self.key and scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                await ApiError(401, "a valid API key is needed: send Authorization: Bearer KEY",
                               code="invalid_api_key").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(server: Server):
    """The ASGI app over `server` (tests and embedders can run it with any ASGI server)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.routing import Route

    async def api_error(request, exc: ApiError):
        if exc.status in (400, 413):
            server.metrics.rejected.labels(status=str(exc.status)).inc()
        return exc.response()

    async def http_error(request, exc: HTTPException):
        message = exc.detail
        if exc.status_code == 404:
            message = "no such endpoint; see GET /v1/models, POST /v1/chat/completions"
        return ApiError(exc.status_code, message, headers=exc.headers).response()

    async def internal(request, exc: Exception):  # uvicorn logs the traceback; the client gets none
        return ApiError(500, "internal server error; the server's log has the details",
                        code="internal_error").response()

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/tokenize", tokenize, methods=["POST"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    app = Starlette(routes=routes, middleware=[Middleware(Auth, key=server.api_key)],
                    exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal})
    app.state.server = server
    return app


# ---- running it

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str, api_key: str | None, insecure: bool) -> None:
    if not is_loopback(host) and not api_key and not insecure:
        raise EdgespecError(f"--host {host} lets other machines use this server; give --api-key KEY (or set "
                            "EDGESPEC_API_KEY), or --insecure to serve them without one")


def serve(model: Model, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          insecure: bool = False, max_queue: int = DEFAULT_MAX_QUEUE, max_body: int = DEFAULT_MAX_BODY,
          temperature: float = 1.0, log_level: str = "info",
          stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS) -> None:
    """Serve `model` until SIGTERM/SIGINT; in-flight requests end at their next round with a final chunk."""
    import uvicorn

    check_host(host, api_key, insecure)
    server = Server(model, api_key=api_key, max_queue=max_queue, max_body=max_body, temperature=temperature,
                    stream_interval_ms=stream_interval_ms)
    config = uvicorn.Config(create_app(server), host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=30, access_log=log_level == "debug")
    _Uvicorn(config, server).run()


class _Stopped(Exception):
    """The signal uvicorn shut down for, raised again after its graceful shutdown (see `_Uvicorn`)."""


class _Uvicorn:
    """uvicorn's server, told about SIGTERM/SIGINT first so in-flight requests end (with a final chunk) instead
    of running to their end while uvicorn waits for them."""

    def __new__(cls, config, server: Server):
        import uvicorn

        class Graceful(uvicorn.Server):
            def handle_exit(self, sig, frame):
                loop = getattr(self, "_edgespec_loop", None)
                if loop is not None:
                    loop.call_soon_threadsafe(server.shutdown)  # not from inside the signal handler itself
                super().handle_exit(sig, frame)

            def run(self, sockets=None):
                """Serve until SIGTERM/SIGINT. uvicorn raises the signal it shut down for again once it is done
                (by default killing the process with it); the shutdown was graceful, so `edgespec serve` returns
                and exits 0 instead: the signal raised again meets `stopped` here, not the default handler."""
                import signal

                if threading.current_thread() is not threading.main_thread():
                    return super().run(sockets)

                def stopped(sig, frame):
                    raise _Stopped

                previous = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    super().run(sockets)
                except _Stopped:
                    pass
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

            async def startup(self, sockets=None):
                self._edgespec_loop = asyncio.get_running_loop()
                await super().startup(sockets)
                if self.started:
                    c = self.config
                    log.info(f"edgespec: serving {server.model.name} at http://{c.host}:{c.port}/v1 "
                             f"(OpenAI API; {'API key required' if server.api_key else 'no API key'})")

        return Graceful(config)


def serve_from_args(args) -> int:
    """`edgespec serve`: check the address, load the pair as `edgespec generate` does, serve."""
    from .api import load_spec
    from .cli import parse_k, runtime_spec
    from .policy import parse_p_min

    api_key = args.api_key or os.environ.get("EDGESPEC_API_KEY") or None
    check_host(args.host, api_key, args.insecure)
    if not 0 <= args.port <= 65535:
        raise EdgespecError(f"--port {args.port} is not a port; use 1-65535 (or 0 for any free one)")
    if args.max_queue < 0:
        raise EdgespecError(f"--max-queue {args.max_queue} is negative; use 0 (no waiting) or more")
    if args.stream_interval is None:
        args.stream_interval = DEFAULT_STREAM_INTERVAL_MS
    if not 0 <= args.stream_interval <= 10_000:
        raise EdgespecError(f"--stream-interval {args.stream_interval} is out of range; use 0 (an event per round) "
                            "to 10000 milliseconds")
    if args.max_body < 1024:
        raise EdgespecError(f"--max-body {args.max_body} is too small; use at least 1024 bytes")
    model = load_spec(runtime_spec(args), k=parse_k(args.k), temperature=args.temperature,
                      p_min=parse_p_min(args.p_min), profile=args.profile, name=args.model_name)
    serve(model, host=args.host, port=args.port, api_key=api_key, insecure=args.insecure, max_queue=args.max_queue,
          max_body=args.max_body, temperature=args.temperature, log_level=args.log_level,
          stream_interval_ms=args.stream_interval)
    return 0
