"""`edgespec chat --server URL`: the real app, with the factory the CLI gives it, against a real `edgespec serve`
subprocess (the tiny checkpoints on torch, as tests/test_server.py starts it); and the command line's checks."""

from __future__ import annotations

import http.client
import json
import re

import pytest
from fakes import CAP, wait_until
from test_server import HOLD, TORCH, free_port, metric, serving
from test_server import wait_until as wait_for

from edgespec.cli import build_parser, check_server_args, load_chat_model, main
from tui.app import STOPPED, ChatApp
from tui.history import load_chat
from tui.widgets import AssistantMessage, PromptInput

LONG = "wvh"  # greedy on the tiny target: no end of answer in 1,500 tokens (checked below)


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    with serving("--target", t, "--draft", d, *TORCH, "--k", "3") as s:
        yield s
        assert "Traceback" not in s.output()


def remote_app(url: str, **kwargs) -> ChatApp:
    """The app as `edgespec chat --server URL` makes it."""
    args = build_parser().parse_args(["chat", "--server", url])
    check_server_args(args)
    return ChatApp(lambda progress: load_chat_model(args, progress), stream_interval=0, **kwargs)


def answers(app) -> list[AssistantMessage]:
    return list(app.query(AssistantMessage))


async def turn(pilot, text: str) -> AssistantMessage:
    n = len(answers(pilot.app))
    pilot.app.query_one(PromptInput).insert(text)
    await pilot.press("enter")
    await wait_until(pilot, lambda: len(answers(pilot.app)) == n + 1 and not pilot.app.generating, what="answer")
    return answers(pilot.app)[-1]


def server_answer(server, messages: list[dict], max_tokens: int) -> dict:
    """The server's own greedy answer (not streamed), as any OpenAI client would get it."""
    status, _, body = server.request("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                                      "temperature": 0, "edgespec": {"k": 3}})
    assert status == 200, body
    return body


@pytest.mark.asyncio
async def test_turns_are_the_servers_greedy_answers(server):
    app = remote_app(server.url, settings={"max_new_tokens": 24, "k": 3})
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.model is not None, what="the server's model")
        first = await turn(pilot, "hello there")
        status = str(app.query_one("#status").content)
        second = await turn(pilot, "and again")
    direct = server_answer(server, [{"role": "user", "content": "hello there"}], 24)
    text = direct["choices"][0]["message"]["content"]
    assert text and first.text == text and first.marker == ""
    # the pieces keep the origins the server streamed: the drafts it accepted show as drafts
    pieces = app.record.messages[1]["pieces"]
    assert "".join(t for t, _ in pieces) == text and {o for _, o in pieces} == {"draft", "target"}
    assert direct["edgespec"]["num_accepted_tokens"] > 0
    # the status bar: the server's model, and the turn's numbers from the server's final chunk
    assert f"@ 127.0.0.1:{server.port}" in status and re.search(r"\d+\.\d tok/s", status)
    assert f"acceptance {direct['edgespec']['acceptance_rate']:.2f}" in status
    # the second turn sent the whole conversation: the server's answer to it is the same
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": text},
               {"role": "user", "content": "and again"}]
    assert second.text == server_answer(server, history, 24)["choices"][0]["message"]["content"]
    # the chat was saved as any other, naming the server's model
    saved = load_chat(app.record.id)
    assert [m["content"] for m in saved.messages] == [m["content"] for m in history] + [second.text]
    assert saved.target == app.model.description["target"] and f"127.0.0.1:{server.port}" in saved.target


@pytest.mark.asyncio
async def test_escape_stops_the_answer_and_the_servers_request(server):
    whole = server_answer(server, [{"role": "user", "content": LONG}], 1500)
    assert whole["choices"][0]["finish_reason"] == "length"  # no end of answer: only the budget stops it
    whole = whole["choices"][0]["message"]["content"]
    before = server.metrics()
    app = remote_app(server.url, settings={"max_new_tokens": 1500, "k": 3})
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.model is not None, what="the server's model")
        app.query_one(PromptInput).insert(LONG)
        await pilot.press("enter")
        await wait_until(pilot, lambda: answers(app) and answers(app)[0].text, what="the first text")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.generating, what="the answer to stop")
        view = answers(app)[0]
    assert view.marker == STOPPED and app.record.messages[-1]["stopped"]
    assert whole.startswith(view.text) and 0 < len(view.text) < len(whole)  # the greedy answer, cut short
    # the server saw the client go and cancelled the request long before its budget
    aborted = metric(before, "edgespec:request_success_total", finished_reason="abort")
    wait_for(lambda: metric(server.metrics(), "edgespec:request_success_total", finished_reason="abort") > aborted,
             "the server to cancel the request")
    generated = metric(server.metrics(), "edgespec:generation_tokens_total") - metric(
        before, "edgespec:generation_tokens_total")
    assert 0 < generated < 1500 and server.idle()


@pytest.mark.asyncio
async def test_escape_while_waiting_for_the_device_takes_the_request_out_of_the_line(server):
    """Nothing comes back before the first round (the headers go out with it): Escape hangs up anyway."""
    before = server.metrics()
    app = remote_app(server.url, settings={"max_new_tokens": 64, "k": 3})
    hold = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CAP)
    try:
        async with app.run_test() as pilot:
            await wait_until(pilot, lambda: app.model is not None, what="the server's model")
            # another client holds the device for 1,500 tokens (its answer is read at the end)
            hold.request("POST", "/v1/completions", json.dumps({"prompt": HOLD, "max_tokens": 1500, "temperature": 0,
                                                                "stream": True}), {"Content-Type": "application/json"})
            await wait_until(pilot, lambda: server.health()["running"] == 1, what="the device held")
            app.query_one(PromptInput).insert("wait your turn")
            await pilot.press("enter")
            await wait_until(pilot, lambda: server.health()["waiting"] == 1, what="the turn in the server's line")
            await pilot.press("escape")
            await wait_until(pilot, lambda: not app.generating, what="the answer to stop")
            view = answers(app)[0]
        assert view.marker == STOPPED and view.text == ""
        assert hold.getresponse().read().endswith(b"data: [DONE]\n\n")  # the holder's answer went on, whole
    finally:
        hold.close()
    after = server.metrics()
    # ours left the line without a token: everything generated was the holder's
    generated = metric(after, "edgespec:generation_tokens_total") - metric(before, "edgespec:generation_tokens_total")
    assert generated == 1500
    for reason, n in (("abort", 1), ("length", 1)):
        assert (metric(after, "edgespec:request_success_total", finished_reason=reason)
                - metric(before, "edgespec:request_success_total", finished_reason=reason)) == n


@pytest.mark.asyncio
async def test_a_server_error_is_the_turns_one_line_error(server):
    app = remote_app(server.url, settings={"max_new_tokens": 8})
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.model is not None, what="the server's model")
        view = await turn(pilot, "x" * 3000)  # past the tiny target's context of 2048
        assert view.has_class("failed")
    error = app.record.messages[-1]["error"]
    assert error.startswith(f"the server at {server.url} answered 400: the prompt has ") and "\n" not in error
    assert view.marker == f"[error] {error}"


@pytest.mark.asyncio
async def test_a_refused_connection_is_a_one_line_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    app = remote_app(url)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.return_code is not None, what="the app to give up")
        title = str(app.query_one("#loading-title").content)
    assert app.return_code == 2 and app.model is None
    assert title == (f"Could not start: cannot reach the server at {url} (connection refused); start it with "
                     "`edgespec serve` or check --server")


def test_a_refused_connection_from_the_command_line(monkeypatch, capfd):
    import tui.app

    class Headless(tui.app.ChatApp):
        def run(self, **kwargs):
            return super().run(headless=True, **kwargs)

    monkeypatch.setattr(tui.app, "ChatApp", Headless)
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["chat", "--server", url + "/v1"]) == 2
    err = " ".join(capfd.readouterr().err.split())  # the app's exit message wraps at the terminal's width
    assert err == (f"edgespec: error: cannot reach the server at {url} (connection refused); start it with "
                   "`edgespec serve` or check --server")


@pytest.mark.parametrize("argv,message", [
    (["--server", "http://127.0.0.1:8000", "--target", "./m"],
     "--server chats with the model that server runs; drop --target (give model options to `edgespec serve` instead)"),
    (["--server", "127.0.0.1:8000", "--pair", "p", "--draft", "ngram", "--threads", "2"],
     "drop --pair, --draft, --threads (give"),
    (["--api-key", "k"], "--api-key goes with --server URL"),
    (["--server", "ftp://127.0.0.1:8000"], "--server 'ftp://127.0.0.1:8000' is not a server address"),
    (["--server", "http://127.0.0.1:99999"], "is not a server address; give it as `edgespec serve` prints it"),
])
def test_server_options_are_checked_first(argv, message, capsys):
    assert main(["chat", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgespec: error: ") and message in err and err.count("\n") == 1


def test_a_refused_key_and_a_full_line_are_one_line_errors(tiny_checkpoints):
    """What `chat --server` meets from a server with --api-key (401) and with a full line (429)."""
    import threading

    from edgespec.errors import EdgespecError
    from edgespec.remote import RemoteModel

    with serving("--target", str(tiny_checkpoints["target"]), *TORCH, "--k", "0", "--api-key", "sesame",
                 "--max-queue", "1") as s:
        for key, said in ((None, "none was given"), ("open", "the key given was refused")):
            with pytest.raises(EdgespecError) as err:
                RemoteModel(s.url, api_key=key)
            assert str(err.value) == (f"the server at {s.url} needs its API key ({said}): pass --api-key KEY or "
                                      "set EDGESPEC_API_KEY")
        model = RemoteModel(s.url, api_key="sesame")
        ask = [{"role": "user", "content": HOLD}]
        holder = model.chat(ask, max_tokens=1500)
        next(iter(holder))  # running: the device is busy
        stop_waiter = threading.Event()

        def wait_in_line():
            list(model.chat(ask, max_tokens=4, cancel=stop_waiter))

        waiter = threading.Thread(target=wait_in_line, daemon=True)
        waiter.start()
        wait_for(lambda: (s.health() or {}).get("waiting") == 1, "the second request to wait in the line")
        with pytest.raises(EdgespecError) as err:
            list(model.chat(ask, max_tokens=4))
        message = str(err.value)
        assert message.startswith(f"the server at {s.url} answered 429: ") and "--max-queue" in message
        assert "\n" not in message
        holder.close()
        stop_waiter.set()
        waiter.join(CAP)
        assert not waiter.is_alive()
        assert "Traceback" not in s.output()
