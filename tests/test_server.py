"""`edgespec serve` as users run it: a subprocess on a free loopback port, called with the real `openai` client
(and raw HTTP where a client would hide what is tested). One server per module (tiny checkpoints, torch
backends); the shutdown test and the embedded-default test start their own."""

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from edgespec.cli import main

CAP = 240.0  # generous: the test machine may be busy
HOLD = "hold the device"  # greedy on the tiny target: 1,500 tokens without an end of answer (checked below)
TORCH = ["--target-backend", "torch", "--draft-backend", "torch"]


def wait_until(predicate, what: str, cap: float = CAP):
    """Poll until `predicate()` is truthy and return it (no fixed sleeps: a cap instead)."""
    end = time.monotonic() + cap
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=CAP, **kwargs)

    def request(self, method: str, path: str, body=None, headers=None):
        """Raw HTTP: (status, headers, parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=CAP)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            raw = resp.read().decode()
            kind = resp.getheader("content-type", "")
            return resp.status, dict(resp.getheaders()), json.loads(raw) if "json" in kind else raw
        finally:
            conn.close()

    def health(self):
        try:
            return self.request("GET", "/health")[2]
        except OSError:
            return None

    def metrics(self) -> dict:
        """{(sample name, frozenset(labels)): value} from /metrics, parsed as Prometheus text."""
        status, headers, text = self.request("GET", "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def idle(self) -> bool:
        h = self.health()
        return h is not None and h["running"] == 0 and h["waiting"] == 0

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


@contextlib.contextmanager
def serving(*args):
    """`edgespec serve ARGS` on a free loopback port, up once /health answers; SIGTERM at the end."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="edgespec-serve-", suffix=".log")[1])
    # One torch thread: the tiny models' steps are microseconds of work, and on a busy machine two spinning
    # intra-op threads made each step ~40x slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", *args, "--port", str(port),
                                 "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT, env=env)
    served = Served(proc, port, log)
    try:
        wait_until(lambda: proc.poll() is not None or served.health(), "the server to answer /health")
        assert proc.poll() is None, served.output()
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(CAP)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    with serving("--target", t, "--draft", d, *TORCH, "--k", "3", "--max-queue", "16") as s:
        yield s
        assert "Traceback" not in s.output()  # nothing in this module fails inside the server


def chat(client, content, **kwargs):
    return client.chat.completions.create(model="target", messages=[{"role": "user", "content": content}],
                                          **kwargs)


def test_completions_equal_edgespec_generate(server, tiny_checkpoints, capsys):
    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    assert main(["generate", *TORCH, "--target", t, "--draft", d, "--k", "3", "--prompt", "hello world",
                 "--max-new-tokens", "24", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    client = server.client()
    r = client.completions.create(model="target", prompt="hello world", max_tokens=24, temperature=0)
    assert r.choices[0].text == cli["text"] and r.object == "text_completion"
    assert r.usage.completion_tokens == len(cli["token_ids"]) and r.usage.prompt_tokens == cli["prompt_tokens"]
    assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[cli["stop_reason"]]
    extra = r.model_extra
    m = cli["metrics"]
    assert extra["edgespec"]["k_per_round"] == m["k_per_round"] and extra["edgespec"]["drafter"] == "torch"
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == m["num_accepted_tokens"]
    assert details.rejected_prediction_tokens == m["num_draft_tokens"] - m["num_accepted_tokens"]
    timings = extra["timings"]
    assert timings["predicted_n"] == len(cli["token_ids"]) and timings["draft_n"] == m["num_draft_tokens"]
    assert timings["draft_n_accepted"] == m["num_accepted_tokens"] and timings["predicted_per_second"] > 0
    # streamed, the same text
    chunks = list(client.completions.create(model="target", prompt="hello world", max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cli["text"]


def test_a_stream_interval_sends_rounds_together(tiny_checkpoints):
    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    with serving("--target", t, "--draft", d, *TORCH, "--k", "1", "--stream-interval", "10000") as s:
        client = s.client()
        whole = client.completions.create(model="target", prompt="hello world", max_tokens=24, temperature=0)
        rounds = len(whole.model_extra["edgespec"]["k_per_round"])
        chunks = list(client.completions.create(model="target", prompt="hello world", max_tokens=24,
                                                temperature=0, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    # the first text goes out at once (time to first token), every later round within 10 s of it waits for the end
    assert rounds > 3 and len(texts) == 2
    assert "".join(texts) == whole.choices[0].text


def test_chat_streaming_and_not_with_usage(server, tiny_checkpoints):
    client = server.client()
    whole = chat(client, "hi there", max_tokens=20, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert text and whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.usage.prompt_tokens > len("hi there")  # the chat template's role markers
    chunks = list(chat(client, "hi there", max_tokens=20, temperature=0, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["timings"]["predicted_n"] == whole.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_ends_with_done(server):
    status, headers, body = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hey"}], "max_tokens": 6, "temperature": 0, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in body.split("\n\n") if line]
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_stop_strings_and_seeds(server):
    client = server.client()
    full = chat(client, "the cat", max_tokens=30, temperature=0).choices[0].message.content
    stop = full[3:5]
    cut = chat(client, "the cat", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = chat(client, "the cat", max_tokens=30, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[: full.find(stop)]

    def sample(seed):
        return chat(client, "the cat", max_tokens=16, temperature=0.9, seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_a_follow_up_turn_reuses_the_cached_prefix(server):
    client = server.client()
    turn1 = [{"role": "user", "content": "tell me more"}]
    a = client.chat.completions.create(model="target", messages=turn1, max_tokens=12, temperature=0)
    turn2 = [*turn1, {"role": "assistant", "content": a.choices[0].message.content},
             {"role": "user", "content": "go on"}]
    b = client.chat.completions.create(model="target", messages=turn2, max_tokens=12, temperature=0)
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached >= a.usage.prompt_tokens
    assert b.model_extra["timings"]["prompt_n"] == b.usage.prompt_tokens - cached


def test_per_request_speculation_k_and_drafter(server):
    client = server.client()
    base = chat(client, "on and on", max_tokens=20, temperature=0)
    off = chat(client, "on and on", max_tokens=20, temperature=0, extra_body={"edgespec": {"speculation": False}})
    k1 = chat(client, "on and on", max_tokens=20, temperature=0, extra_body={"edgespec": {"k": 1}})
    ngram = chat(client, "on and on", max_tokens=20, temperature=0, extra_body={"edgespec": {"drafter": "ngram"}})
    text = base.choices[0].message.content
    assert off.choices[0].message.content == k1.choices[0].message.content == ngram.choices[0].message.content == text
    assert off.model_extra["edgespec"]["drafter"] == "none" and off.model_extra["timings"]["draft_n"] == 0
    assert off.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert max(k1.model_extra["edgespec"]["k_per_round"]) == 1
    assert ngram.model_extra["edgespec"]["drafter"] == "ngram"
    streamed = list(chat(client, "on and on", max_tokens=20, temperature=0, stream=True,
                         extra_body={"edgespec": {"origins": True}}))
    origins = [o for c in streamed for _, o in (c.model_extra.get("edgespec") or {}).get("origins", [])]
    assert origins and set(origins) <= {"draft", "target"}


def test_tokenize_counts_what_the_requests_count(server):
    client = server.client()
    messages = [{"role": "user", "content": "how many?"}]
    chat_usage = client.chat.completions.create(model="target", messages=messages, max_tokens=2, temperature=0).usage
    text_usage = client.completions.create(model="target", prompt="how many?", max_tokens=2, temperature=0).usage
    status, _, chat_tokens = server.request("POST", "/tokenize", {"messages": messages})
    assert status == 200 and chat_tokens["count"] == chat_usage.prompt_tokens == len(chat_tokens["tokens"])
    status, _, text_tokens = server.request("POST", "/tokenize", {"prompt": "how many?"})
    assert status == 200 and text_tokens["count"] == text_usage.prompt_tokens and text_tokens["max_model_len"] == 2048
    r = client.completions.create(model="target", prompt=text_tokens["tokens"], max_tokens=8, temperature=0)
    assert r.choices[0].text == client.completions.create(model="target", prompt="how many?", max_tokens=8,
                                                          temperature=0).choices[0].text  # token ids as a prompt


def test_models_health_and_metrics_move(server):
    status, _, models = server.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["target"]
    before = server.metrics()
    r = chat(server.client(), "count me", max_tokens=10, temperature=0)
    after = server.metrics()
    finished = sum(metric(after, "edgespec:request_success_total", finished_reason=f) -
                   metric(before, "edgespec:request_success_total", finished_reason=f) for f in ("stop", "length"))
    assert finished == 1
    assert (metric(after, "edgespec:generation_tokens_total") - metric(before, "edgespec:generation_tokens_total")
            == r.usage.completion_tokens)
    assert (metric(after, "edgespec:prompt_tokens_total") - metric(before, "edgespec:prompt_tokens_total")
            == r.usage.prompt_tokens)
    drafted = (metric(after, "edgespec:spec_decode_num_draft_tokens_total")
               - metric(before, "edgespec:spec_decode_num_draft_tokens_total"))
    accepted = (metric(after, "edgespec:spec_decode_num_accepted_tokens_total")
                - metric(before, "edgespec:spec_decode_num_accepted_tokens_total"))
    assert drafted > 0 and drafted - accepted == r.usage.completion_tokens_details.rejected_prediction_tokens
    per_pos = sum(v for (name, _), v in after.items() if name == "edgespec:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == metric(after, "edgespec:spec_decode_num_accepted_tokens_total")
    for name in ("edgespec:time_to_first_token_seconds_count", "edgespec:e2e_request_latency_seconds_count"):
        assert metric(after, name) == metric(before, name) + 1
    assert metric(after, "edgespec:inter_token_latency_seconds_count") > metric(before, "edgespec:inter_token_latency_seconds_count")
    assert metric(after, "edgespec:num_requests_running") == 0


def test_a_client_that_disconnects_cancels_its_request(server):
    status, _, hold = server.request("POST", "/v1/completions", {"prompt": HOLD, "max_tokens": 40, "temperature": 0})
    assert hold["choices"][0]["finish_reason"] == "length"  # no end of answer: only the budget stops it
    before = server.metrics()
    stream = server.client().completions.create(model="target", prompt=HOLD, max_tokens=1500, temperature=0,
                                                stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-answer
    wait_until(lambda: metric(server.metrics(), "edgespec:request_success_total", finished_reason="abort")
               > metric(before, "edgespec:request_success_total", finished_reason="abort"), "the request to end")
    after = server.metrics()
    generated = metric(after, "edgespec:generation_tokens_total") - metric(before, "edgespec:generation_tokens_total")
    assert 0 < generated < 750  # it stopped long before its budget: nothing generates for nobody
    assert server.idle()
    r = chat(server.client(), "next please", max_tokens=8, temperature=0)  # and the next request is served
    assert r.usage.completion_tokens > 0


def test_sixteen_streaming_clients_get_their_whole_answers(server):
    client = server.client()
    prompts = [f"prompt number {i}: {'abcdefghijklmnop'[i] * 3}" for i in range(16)]
    alone = {p: client.completions.create(model="target", prompt=p, max_tokens=10, temperature=0).choices[0].text
             for p in prompts}
    got, errors, ids = {}, [], set()

    def run(p):
        try:
            texts = []
            for c in client.completions.create(model="target", prompt=p, max_tokens=10, temperature=0, stream=True):
                ids.add(c.id)
                texts.append(c.choices[0].text if c.choices else "")
            got[p] = "".join(texts)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CAP)
    assert not errors and len(ids) == 16
    assert got == alone  # every answer whole, none mixed up with another's


def test_past_the_queue_a_request_gets_429_with_retry_after(server):
    body = json.dumps({"prompt": HOLD, "max_tokens": 1500, "temperature": 0, "stream": True}).encode()

    writers = []

    async def post():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writers.append(writer)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        return status, headers, reader

    async def scenario():
        holder = await post()  # running: its headers came with its first round
        assert holder[0] == 200
        tasks = [asyncio.create_task(post()) for _ in range(17)]  # 16 fill the line, one is too many
        try:
            refused = None
            while refused is None:
                pending = [t for t in tasks if not t.done()]
                assert pending, [t.result()[0] for t in tasks]
                done, _ = await asyncio.wait(pending, timeout=CAP, return_when=asyncio.FIRST_COMPLETED)
                assert done, "no answer from the server"
                refused = next((t.result() for t in done if t.result()[0] == 429), None)
            status, headers, reader = refused
            return headers, json.loads(await reader.readexactly(int(headers["content-length"])))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in writers:  # everyone hangs up: the running request ends, the line empties unrun
                w.close()

    before = server.metrics()
    headers, error = asyncio.run(scenario())
    assert int(headers["retry-after"]) >= 1
    assert error["error"]["code"] == "queue_full" and "--max-queue" in error["error"]["message"]
    wait_until(server.idle, "the line to empty")
    after = server.metrics()
    assert metric(after, "edgespec:request_rejected_total", status="429") > metric(before, "edgespec:request_rejected_total", status="429")
    assert chat(server.client(), "still here?", max_tokens=6, temperature=0).usage.completion_tokens > 0


BAD = [
    ("chat", {"model": "target"}, 400, "messages"),
    ("chat", {"messages": "hello"}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, 400, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "seed": -3}, 400, "seed"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, 400, "model"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "edgespec": {"k": 99}}, 400, "edgespec.k"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "edgespec": {"drafter": "x"}}, 400, "edgespec.drafter"),
    ("chat", {"messages": [{"role": "user", "content": "a" * 3000}]}, 400, "messages"),
    ("completions", {"prompt": "a" * 3000}, 400, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 999]}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"prompt": "x" * (10 * 2**20)}, 413, None),
]


@pytest.mark.parametrize("endpoint, body, status, param", BAD,
                         ids=[f"{e}-{p or s}-{i}" for i, (e, _, s, p) in enumerate(BAD)])
def test_bad_requests_get_openai_shaped_errors(server, endpoint, body, status, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    got, headers, error = server.request("POST", path, body)
    assert got == status, error
    assert headers["content-type"] == "application/json"
    assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["message"]
    assert error["error"]["param"] == param and "Traceback" not in error["error"]["message"]
    assert server.health()["status"] == "ok"  # and the server keeps serving


def test_unknown_paths_and_methods_are_json_errors(server):
    status, _, error = server.request("GET", "/v1/nothing")
    assert status == 404 and error["error"]["message"]
    status, _, error = server.request("GET", "/v1/chat/completions")
    assert status == 405 and error["error"]["message"]


def test_non_loopback_host_needs_an_api_key(tiny_checkpoints, capsys):
    assert main(["serve", "--target", str(tiny_checkpoints["target"]), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--api-key" in err[0] and "--insecure" in err[0]


@pytest.mark.parametrize("flag, value", [("--stream-interval", "-5"), ("--max-queue", "-1"), ("--port", "70000")])
def test_bad_serve_options_are_one_line_errors(tiny_checkpoints, capsys, flag, value):
    assert main(["serve", "--target", str(tiny_checkpoints["target"]), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0]


def test_api_key_and_graceful_shutdown(tiny_checkpoints):
    """With a key, requests without it get 401; SIGTERM mid-stream ends the stream with a final chunk and [DONE]."""
    with serving("--target", str(tiny_checkpoints["target"]), *TORCH, "--k", "2", "--api-key", "sesame") as s:
        status, _, error = s.request("GET", "/v1/models")
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
        assert s.request("GET", "/v1/models", headers={"Authorization": "Bearer sesame"})[0] == 200
        client = OpenAI(base_url=s.url + "/v1", api_key="sesame", max_retries=0, timeout=CAP)
        stream = client.completions.create(model="target", prompt=HOLD, max_tokens=1500, temperature=0, stream=True)
        chunks = iter(stream)
        seen = [next(chunks)]
        s.proc.send_signal(signal.SIGTERM)
        seen.extend(chunks)  # the stream ends by itself, with a final chunk, not a broken connection
        final = seen[-1]
        assert final.choices[0].finish_reason == "abort"
        assert final.model_extra["edgespec"]["stop_reason"] == "shutdown"
        assert final.model_extra["timings"]["predicted_n"] < 1500
        # a graceful shutdown is a clean exit: status 0 (not death by the signal uvicorn raises again)
        assert s.proc.wait(CAP) == 0
        assert "Traceback" not in s.output()


def test_ctrl_c_on_an_idle_server_exits_0(tiny_checkpoints):
    with serving("--target", str(tiny_checkpoints["target"]), *TORCH, "--draft", "none") as s:
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(CAP) == 0
        out = s.output()
        assert "Traceback" not in out and "interrupted" not in out


def test_the_embedded_default_serves_chat():
    """SmolLM2-135M with its INT4 drafter (cached after the first run): speculation on and off give one answer."""
    with serving("--k", "3", "--target-backend", "onnx", "--target-device", "cpu") as s:
        client = s.client()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        on = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0)
        off = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0,
                                             extra_body={"edgespec": {"speculation": False}})
        assert on.choices[0].message.content == off.choices[0].message.content and on.usage.completion_tokens > 5
        assert on.usage.completion_tokens_details.accepted_prediction_tokens > 0  # the draft model agrees often
        assert on.model_extra["edgespec"]["drafter"] != "none" and off.model_extra["edgespec"]["drafter"] == "none"
