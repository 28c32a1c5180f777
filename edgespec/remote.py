"""`RemoteModel`: a running `edgespec serve` as the model of `edgespec chat --server URL`.

It has what the chat app uses of `edgespec.api.Model`: `chat(messages, system=, stream=True, cancel=, **settings)`
streaming chunks of (text, origin) pieces with the turn's metrics, `description` and `has_chat_template`. A turn
is one streamed POST /v1/chat/completions asking for `edgespec.origins`, so each piece keeps its origin (draft or
target); a server without that extension (another OpenAI-compatible one) gives plain text, all marked "target".
The server streams text only: the turn's metrics come with its final chunk (`timings` and the `edgespec` block),
so the chunks before it carry empty metrics. Cancelling closes the connection, which the server takes as
cancelling the request (in its line, or at the end of the current round).

HTTP goes through the standard library's http.client, not a client library: no dependency, and its socket can be
shut down from another thread, which wakes a read blocked on a server that has sent nothing yet (the response's
headers only go out with the first round, after the wait for the device and the prefill), so Escape works then too.

It loads no model and imports neither torch nor the engine.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from .errors import EdgespecError
from .metrics import TARGET, Chunk, SpecMetrics

CONNECT_TIMEOUT = 30.0  # s: to connect, and for the small requests at start (the answers wait as long as they must)
CANCEL_POLL = 0.05  # s: how often a streaming answer looks at its cancel event (as edgespec.api.FairLock)


@dataclass(frozen=True)
class ServerUrl:
    scheme: str
    host: str
    port: int
    path: str  # the prefix before /v1 ("" for a server at the root)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


def parse_server_url(text: str) -> ServerUrl:
    """`--server`'s value: http(s)://HOST:PORT, with or without /v1 (http:// when it names no scheme)."""
    bad = EdgespecError(f"--server {text!r} is not a server address; give it as `edgespec serve` prints it, "
                        "like http://127.0.0.1:8000")
    full = text.strip() if "://" in text else "http://" + text.strip()
    parts = urllib.parse.urlsplit(full)
    try:
        port = parts.port
    except ValueError:
        raise bad from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise bad
    path = parts.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    return ServerUrl(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path)


class RemoteModel:
    """A running `edgespec serve` at `url`; see the module's docstring. Connects at once (GET /v1/models), so a
    server that is not there is a one-line `EdgespecError` before the chat starts."""

    def __init__(self, url: str, api_key: str | None = None):
        self.url = parse_server_url(url)
        self.api_key = api_key
        models = self._json("GET", "/v1/models")
        try:
            info = models["data"][0]
            self.name = str(info["id"])
        except (KeyError, IndexError, TypeError):
            raise EdgespecError(f"{self.url}/v1/models lists no model; is it an OpenAI-compatible server "
                                "(`edgespec serve`)?") from None
        ext = info.get("edgespec") or {}  # edgespec serve's: the model's own `description`
        self.description = {"target": f"{ext.get('target') or self.name} @ {self.url.host}:{self.url.port}",
                            "draft": ext.get("draft"), "drafter": ext.get("drafter"), "k": ext.get("k")}
        self.has_chat_template = self._has_chat_template()

    def _has_chat_template(self) -> bool:
        """Whether the served model applies a chat template, asked of /tokenize (vLLM's, which edgespec serve has):
        it answers 400 for a model without one. A server without /tokenize is trusted until the first turn."""
        status, _ = self._request("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
        return status != 400

    # ---- turns

    def chat(self, messages: list[dict], *, system: str | None = None, stream: bool = True,
             cancel: threading.Event | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             max_tokens: int | None = 512, k: int | str = "auto", speculation: bool = True,
             seed: int | None = None) -> Iterator[Chunk]:
        """Stream the server's answer to `messages` (role/content dicts), as `Model.chat(..., stream=True)` does.
        The server validates the settings (a bad one is its 400, as a one-line EdgespecError)."""
        if not stream:
            raise ValueError("RemoteModel.chat only streams: pass stream=True and iterate the answer")
        body = {"model": self.name, "stream": True,
                "messages": ([{"role": "system", "content": system}] if system else [])
                + [{"role": m["role"], "content": m["content"]} for m in messages],
                "temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens,
                "edgespec": {"k": k, "speculation": speculation, "origins": True}}
        if seed is not None:
            body["seed"] = seed
        return self._answer(body, cancel if cancel is not None else threading.Event())

    def _answer(self, body: dict, cancel: threading.Event) -> Iterator[Chunk]:
        metrics = SpecMetrics()
        final = None
        conn = self._connect()
        conn.sock.settimeout(None)  # the first round may be long in coming: the server's line, a long prefill
        done = threading.Event()
        hang_up = threading.Thread(target=_hang_up, args=(conn.sock, cancel, done), name="edgespec-hang-up",
                                   daemon=True)
        hang_up.start()
        try:
            try:
                response = self._send(conn, "POST", "/v1/chat/completions", body)
                if response.status >= 400:
                    raise self._refused(response.status, response.read())
                for event in _events(response, self.url):
                    if "error" in event:  # mid-stream: OpenAI's streams carry an error object
                        raise EdgespecError(f"the server at {self.url} failed during the answer: "
                                            f"{_message(event['error'])}")
                    choices = event.get("choices") or []
                    if not choices or final is not None:
                        continue  # the usage chunk; nothing but it comes after the final chunk
                    ext = event.get("edgespec") or {}
                    text = (choices[0].get("delta") or {}).get("content") or ""
                    origins = ext.get("origins")
                    pieces = [(t, o) for t, o in origins] if origins else [(text, TARGET)] if text else []
                    if ext.get("notice"):
                        metrics.notices.append(ext["notice"])
                    finish = choices[0].get("finish_reason")
                    if finish is None:
                        if pieces or ext.get("notice"):
                            yield Chunk(pieces, 0, metrics)
                        continue
                    k, reason = self._read_metrics(event, finish, metrics)
                    final = Chunk(pieces, k, metrics, reason)  # yielded after [DONE]
            except (OSError, http.client.HTTPException) as err:
                if not cancel.is_set() and final is None:  # else: our own hang-up, or a loss after the answer
                    raise EdgespecError(f"lost the connection to the server at {self.url} ({_why(err)})") from None
            if final is None:
                if not cancel.is_set():
                    raise EdgespecError(f"the server at {self.url} ended the answer without its final chunk; "
                                        "its log may say why")
                final = Chunk([], 0, metrics, "cancelled")
            yield final
        finally:
            done.set()
            hang_up.join()  # before the socket closes: it must not shut down a descriptor reused meanwhile
            conn.close()

    def _read_metrics(self, event: dict, finish: str, metrics: SpecMetrics) -> tuple[int, str]:
        """Fill `metrics` from the final chunk's `timings` (llama.cpp server's) and `edgespec` blocks, so that
        tokens/s, acceptance and tau come out as the server computed them; (the last round's K, the stop reason)."""
        timings = event.get("timings") or {}
        ext = event.get("edgespec") or {}
        reason = ext.get("stop_reason") or finish
        if reason == "shutdown":
            raise EdgespecError(f"the server at {self.url} shut down during the answer")
        metrics.num_emitted_tokens = int(timings.get("predicted_n", 0))
        metrics.prefill_ms = float(timings.get("prompt_ms", 0.0))
        # decode tokens/s = emitted / (wall - prefill): the server's predicted_ms is that difference
        metrics.wall_s = (metrics.prefill_ms + float(timings.get("predicted_ms", 0.0))) / 1000
        metrics.k_per_round = list(ext.get("k_per_round", []))
        metrics.num_target_forwards = len(metrics.k_per_round)  # tau = emitted / target passes
        metrics.num_drafts = int(ext.get("num_drafts", 0))
        metrics.num_draft_tokens = int(ext.get("num_draft_tokens", timings.get("draft_n", 0)))
        metrics.num_accepted_tokens = int(ext.get("num_accepted_tokens", timings.get("draft_n_accepted", 0)))
        return (metrics.k_per_round[-1] if metrics.k_per_round else 0), reason

    # ---- HTTP

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.url.scheme == "https" else http.client.HTTPConnection
        conn = kind(self.url.host, self.url.port, timeout=CONNECT_TIMEOUT)
        try:
            conn.connect()
        except OSError as err:
            conn.close()
            raise EdgespecError(f"cannot reach the server at {self.url} ({_why(err)}); start it with "
                                "`edgespec serve` or check --server") from None
        return conn

    def _send(self, conn: http.client.HTTPConnection, method: str, path: str,
              body: dict | None) -> http.client.HTTPResponse:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, self.url.path + path, body=data, headers=headers)
        return conn.getresponse()

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        """One small request: (status, body). 401 is an error here (every path but /health needs the key)."""
        conn = self._connect()
        try:
            response = self._send(conn, method, path, body)
            status, raw = response.status, response.read()
        except (OSError, http.client.HTTPException) as err:
            raise EdgespecError(f"no answer from the server at {self.url} ({_why(err)}); check --server") from None
        finally:
            conn.close()
        if status == 401:
            raise self._refused(status, raw)
        return status, raw

    def _json(self, method: str, path: str, body: dict | None = None):
        status, raw = self._request(method, path, body)
        if status >= 400:
            raise self._refused(status, raw)
        try:
            return json.loads(raw)
        except ValueError:
            raise EdgespecError(f"{self.url}{path} did not answer JSON; is it an OpenAI-compatible server "
                                "(`edgespec serve`)?") from None

    def _refused(self, status: int, raw: bytes) -> EdgespecError:
        if status == 401:
            given = "the key given was refused" if self.api_key else "none was given"
            return EdgespecError(f"the server at {self.url} needs its API key ({given}): pass --api-key KEY or set "
                                 "EDGESPEC_API_KEY")
        try:
            message = _message(json.loads(raw)["error"])
        except (ValueError, KeyError, TypeError):
            message = " ".join(raw.decode(errors="replace").split())[:200] or http.client.responses.get(status, "")
        return EdgespecError(f"the server at {self.url} answered {status}: {message}")


def _events(response: http.client.HTTPResponse, url: ServerUrl) -> Iterator[dict]:
    """The `data:` payloads of a server-sent-events body, parsed, up to `[DONE]` (edgespec serve sends each event
    as one `data:` line; other fields and blank lines are skipped)."""
    for line in response:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise EdgespecError(f"the server at {url} streamed something that is not JSON: "
                                f"{data[:80].decode(errors='replace')!r}") from None


def _hang_up(sock: socket.socket, cancel: threading.Event, done: threading.Event) -> None:
    """Shut `sock` down once `cancel` is set (until `done`). A read blocked on it then returns, and the server takes
    the disconnect as cancelling the request."""
    while not done.wait(CANCEL_POLL):
        if cancel.is_set():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            return


def _message(error) -> str:
    return str(error.get("message") if isinstance(error, dict) else error)


def _why(err: BaseException) -> str:
    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, socket.gaierror):
        return "unknown host"
    if isinstance(err, TimeoutError):
        return f"no answer in {CONNECT_TIMEOUT:g} s"
    return str(err) or type(err).__name__
