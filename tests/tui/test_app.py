"""The chat app driven through Pilot with a fake model whose stream the test releases chunk by chunk."""

from __future__ import annotations

import shutil

import pytest
from fakes import CAP, GatedModel, fixed_factory, wait_until
from textual.widgets import Input, Static

from edgespec.errors import EdgespecError
from tui.app import ChatApp
from tui.settings import SettingsScreen
from tui.widgets import AssistantMessage, LoadingView, PromptInput, UserMessage

pytestmark = pytest.mark.asyncio


def make_app(model, **kwargs) -> ChatApp:
    return ChatApp(fixed_factory(model), stream_interval=0, **kwargs)


def answers(app) -> list[AssistantMessage]:
    return list(app.query(AssistantMessage))


def status(app) -> str:
    return str(app.query_one("#status", Static).content)


async def ready(pilot) -> None:
    await wait_until(pilot, lambda: pilot.app.model is not None and not pilot.app.query(LoadingView), what="model")


async def send(pilot, text: str) -> None:
    pilot.app.query_one(PromptInput).insert(text)
    await pilot.press("enter")


async def first_chunk_shown(pilot, model: GatedModel, text: str) -> None:
    """Send `text` to a gated model, let its first chunk through and wait until it is on screen."""
    await send(pilot, text)
    model.release()
    await wait_until(pilot, lambda: answers(pilot.app) and answers(pilot.app)[0].text == "Hello there")


async def turn(pilot, text: str) -> AssistantMessage:
    """Send `text` to an ungated model and wait for the whole answer."""
    n = len(answers(pilot.app))
    await send(pilot, text)
    await wait_until(pilot, lambda: len(answers(pilot.app)) == n + 1 and not pilot.app.generating, what="answer")
    return answers(pilot.app)[-1]


async def test_streaming_appears_in_order():
    model = GatedModel()
    app = make_app(model, system="be brief")
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await wait_until(pilot, lambda: len(answers(app)) == 1)
        view = answers(app)[0]
        assert [m.text for m in app.query(UserMessage)] == ["hi"]
        assert app.query_one(PromptInput).text == ""
        seen = []
        for expected in ["Hello there", "Hello there, world", "Hello there, world!"]:
            model.release()
            await wait_until(pilot, lambda expected=expected: view.text == expected, what=expected)
            seen.append(view.text)
        await wait_until(pilot, lambda: not app.generating)
        assert view.marker == ""
        assert view.runs == [["Hello", "draft"], [" there", "target"], [", world", "draft"], ["!", "target"]]
        assert model.calls[0]["messages"] == [{"role": "user", "content": "hi"}]
        assert model.calls[0]["system"] == "be brief"
        assert app.record.messages[-1]["content"] == "Hello there, world!"
        assert "K 4" in status(app) and "tok/s" in status(app)


async def test_escape_cancels_and_keeps_the_partial_answer():
    model = GatedModel()
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        await first_chunk_shown(pilot, model, "hi")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.generating, what="the turn to stop")
        view = answers(app)[0]
        assert view.marker == "[stopped]"
        assert view.text == "Hello there"
        assert app.record.messages[-1] == {"role": "assistant", "content": "Hello there", "stopped": True,
                                           "pieces": [["Hello", "draft"], [" there", "target"]]}

        model.gated = False
        second = await turn(pilot, "again")
        assert second.text == "Hello there, world!" and second.marker == ""
        assert model.calls[1]["messages"] == [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello there"},
            {"role": "user", "content": "again"},
        ]


async def test_sending_while_streaming_is_refused_and_the_text_kept():
    model = GatedModel()
    app = make_app(model)
    notes = []
    app.notify = lambda message, **kwargs: notes.append((message, kwargs.get("severity")))
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "one")
        await wait_until(pilot, lambda: app.generating)
        await send(pilot, "two")
        await pilot.pause()
        # refused: said so, kept in the input, neither in the chat nor queued for after this answer
        assert notes == [("An answer is still streaming: press Escape to stop it first.", "warning")]
        assert app.query_one(PromptInput).text == "two"
        assert [m.text for m in app.query(UserMessage)] == ["one"]
        assert [m["content"] for m in app.record.messages if m["role"] == "user"] == ["one"]
        model.release(3)
        await wait_until(pilot, lambda: not app.generating)
        await pilot.pause()
        assert len(model.calls) == 1 and not app.generating
        assert [m["role"] for m in app.record.messages] == ["user", "assistant"]
        assert app.query_one(PromptInput).text == "two"


async def test_toggling_speculation_changes_the_next_settings_and_measures_the_speedup():
    model = GatedModel(gated=False)
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        await turn(pilot, "a")
        assert model.calls[-1]["settings"].speculation is True
        assert "speedup —" in status(app)
        await pilot.press("f3")
        assert "speculation off" in status(app)
        await turn(pilot, "b")
        assert model.calls[-1]["settings"].speculation is False
        await pilot.press("ctrl+s")
        await turn(pilot, "c")
        assert model.calls[-1]["settings"].speculation is True
        # the fake takes 1 s with speculation and 2 s without for the same tokens
        assert "speedup ×2.00 vs plain" in status(app)


async def test_ctrl_n_starts_a_new_chat():
    model = GatedModel(gated=False)
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        await turn(pilot, "first")
        old_id = app.record.id
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not app.query(".message"))
        assert app.record.id != old_id and app.record.messages == []
        await turn(pilot, "second")
        assert model.calls[-1]["messages"] == [{"role": "user", "content": "second"}]


async def test_ctrl_n_while_streaming_cancels_and_the_old_chat_keeps_its_partial_answer():
    model = GatedModel()
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        await first_chunk_shown(pilot, model, "first")
        old = app.record
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not app.generating)
        assert old.messages[-1]["content"] == "Hello there" and old.messages[-1]["stopped"]
        assert not app.query(".message")


async def test_settings_apply_to_the_next_turn():
    model = GatedModel(gated=False)
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen))
        values = {"temperature": "0.8", "top_p": "0.9", "max_new_tokens": "64", "k": "6"}
        for name, value in values.items():
            app.screen.query_one(f"#set-{name}", Input).value = value
        await pilot.click("#settings-apply")
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        await turn(pilot, "hi")
        s = model.calls[-1]["settings"]
        assert (s.temperature, s.top_p, s.max_new_tokens, s.k) == (0.8, 0.9, 64, 6)


@pytest.mark.parametrize("name,value,message", [
    ("k", "17", "out of range"), ("k", "fast", "neither 'auto'"), ("temperature", "-1", "temperature"),
    ("top_p", "0", "top-p"), ("max_new_tokens", "1.5", "whole number"),
])
async def test_invalid_settings_are_rejected(name, value, message):
    model = GatedModel(gated=False)
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#set-max_new_tokens", Input).value = "99"
        app.screen.query_one(f"#set-{name}", Input).value = value
        await pilot.click("#settings-apply")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen), "an invalid value must keep the dialog open"
        assert message in str(app.screen.query_one("#settings-error", Static).content)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        await turn(pilot, "hi")
        s = model.calls[-1]["settings"]
        assert (s.temperature, s.top_p, s.max_new_tokens, s.k) == (0.0, 1.0, 512, "auto")


async def test_an_error_mid_answer_is_shown_and_the_app_stays_usable():
    model = GatedModel(gated=False, fail_after=1)
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        failed = await turn(pilot, "hi")
        assert failed.text == "Hello there"
        assert failed.marker == "[error] the fake model fell over; try again"
        assert app.record.messages[-1]["error"] == "the fake model fell over; try again"
        ok = await turn(pilot, "again")
        assert ok.text == "Hello there, world!" and ok.marker == ""


async def test_a_bug_in_the_model_is_shown_not_lost_with_the_thread():
    """An unexpected exception (not an EdgespecError) on the model thread ends the answer with its message."""

    class Broken(GatedModel):
        def _answer(self, settings, cancel):
            if len(self.calls) == 1:
                raise KeyError("boom")
            yield from super()._answer(settings, cancel)

    app = make_app(Broken(gated=False))
    async with app.run_test() as pilot:
        await ready(pilot)
        failed = await turn(pilot, "hi")
        assert failed.marker == "[error] KeyError: 'boom'"
        ok = await turn(pilot, "again")
        assert ok.text == "Hello there, world!"


async def test_a_value_the_api_refuses_is_its_one_line_error_in_the_chat():
    """The settings reach `Model.chat` as its keyword arguments: a value the API's validation refuses (the dialog
    lets a seed past the API's range through: set here directly) ends the turn with the API's message."""
    model = GatedModel(gated=False)
    app = make_app(model, settings={"seed": -1})
    async with app.run_test() as pilot:
        await ready(pilot)
        failed = await turn(pilot, "hi")
        assert failed.marker.startswith("[error] seed=-1 is out of range") and failed.text == ""
        app.settings_values["seed"] = 7
        ok = await turn(pilot, "again")
        assert ok.text == "Hello there, world!" and model.calls[-1]["settings"].seed == 7


async def test_a_stream_that_ignores_cancel_is_closed_when_the_app_stops_reading():
    """The app stops reading at the first chunk after Escape even if the model goes on, and closes the stream
    (for `edgespec.api.Stream`: the device is handed on at once)."""
    closed = []

    class Deaf(GatedModel):
        def _answer(self, settings, cancel):
            try:
                yield from super()._answer(settings, None)  # never sees the cancel event
            finally:
                closed.append(True)

    model = Deaf()
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        await first_chunk_shown(pilot, model, "hi")
        await pilot.press("escape")
        model.release()
        await wait_until(pilot, lambda: not app.generating)
        assert closed == [True]
        assert answers(app)[0].marker == "[stopped]" and answers(app)[0].text == "Hello there, world"


async def test_the_model_thread_keeps_its_priority_when_the_ui_lowers_its_own():
    """`ui_nice`: the model thread, started first, keeps normal priority; the UI thread drops to the nice value."""
    import os
    import sys
    import threading

    from tui.app import ModelThread, lower_thread_priority

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice values are Linux's")
    seen = {}

    def ui():  # a stand-in UI thread, so the test runner's own thread keeps its priority
        model = ModelThread()
        seen["lowered"] = lower_thread_priority(10)
        seen["ui"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        done = threading.Event()
        model.submit(lambda: (seen.__setitem__("model", os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
                              done.set()))
        done.wait(CAP)
        model.close()

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=ui)
    t.start()
    t.join(CAP)
    assert seen["lowered"] and seen["ui"] == max(base, 10)
    assert seen["model"] == base


async def test_a_factory_error_exits_nonzero_with_the_message():
    def factory(progress):
        progress("downloading…")
        raise EdgespecError("no such pair 'nope'; see edgespec models")

    app = ChatApp(factory)
    exits, real_exit = [], app.exit

    def exit(*args, **kwargs):
        exits.append(kwargs)
        real_exit(*args, **kwargs)

    app.exit = exit
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.return_code is not None, what="exit")
        title = str(app.query_one("#loading-title", Static).content)
    assert app.return_code == 2
    # the message `edgespec chat` prints on the way out (tests/tui/test_cli_chat.py), and the screen said it too
    assert exits == [{"return_code": 2, "message": "edgespec: error: no such pair 'nope'; see edgespec models"}]
    assert title == "Could not start: no such pair 'nope'; see edgespec models"


async def test_the_loading_view_wraps_long_lines_and_redraws_a_bar_in_place():
    import threading

    from edgespec.progress import BarLine

    go = threading.Event()
    warning = "warning: no profile for this machine and pair; " + "the whole of this line must be read " * 4 + "END"

    def factory(progress):
        progress(warning)
        for done in (10, 60, 100):
            progress(BarLine(f"downloading model.gguf: {done:3d}% {done}M/100MB", key=7))
        progress("ready")
        assert go.wait(CAP)
        return GatedModel(gated=False)

    app = ChatApp(factory, stream_interval=0)
    async with app.run_test(size=(60, 30)) as pilot:
        view = app.query_one(LoadingView)
        await wait_until(pilot, lambda: "ready" in view.lines)
        assert view.lines == [warning, "downloading model.gguf: 100% 100M/100MB", "ready"]
        await pilot.pause()
        log = app.query_one("#loading-log")
        assert log.region.right <= 60 and log.size.height >= -(-len(warning) // log.size.width) + 2  # wrapped
        shown = "".join(strip.text for strip in log.render_lines(log.size.region)).replace(" ", "")
        assert warning.replace(" ", "") in shown and "100M/100MB" in shown and "60M" not in shown
        go.set()
        await wait_until(pilot, lambda: not app.query(LoadingView))


async def test_loading_progress_is_shown_and_a_prompt_sent_early_waits_for_the_model():
    import threading

    go = threading.Event()
    model = GatedModel(gated=False)

    def factory(progress):
        progress("fetching the draft")
        assert go.wait(CAP)
        return model

    app = ChatApp(factory, stream_interval=0)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: "fetching the draft" in app.query_one(LoadingView).lines)
        assert app.query_one(PromptInput).has_focus
        await send(pilot, "early")
        await pilot.pause()
        assert "waiting for the model" in status(app)
        go.set()
        await wait_until(pilot, lambda: answers(app) and not app.generating and not app.query(LoadingView))
        assert answers(app)[0].text == "Hello there, world!"
        assert model.calls[0]["messages"] == [{"role": "user", "content": "early"}]


async def test_up_and_down_walk_earlier_prompts():
    model = GatedModel(gated=False)
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        await turn(pilot, "first")
        await turn(pilot, "second")
        prompt = app.query_one(PromptInput)
        prompt.insert("draft")
        await pilot.press("up")
        assert prompt.text == "second"
        await pilot.press("up")
        assert prompt.text == "first"
        await pilot.press("down")
        assert prompt.text == "second"
        await pilot.press("down")
        assert prompt.text == "draft"


async def test_shift_enter_adds_a_line_instead_of_sending():
    model = GatedModel(gated=False)
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        await pilot.press("a", "shift+enter", "b")
        assert app.query_one(PromptInput).text == "a\nb"
        assert not model.calls
        await pilot.press("enter")
        await wait_until(pilot, lambda: model.calls)
        assert model.calls[0]["messages"][0]["content"] == "a\nb"


async def test_colour_toggle_switches_between_origin_colours_and_markdown():
    model = GatedModel([[("**bold**", "draft")], [(" text", "target")]], gated=False)
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        view = await turn(pilot, "hi")
        coloured, markdown = view.query_one(".coloured"), view.query_one(".markdown")
        assert coloured.display and not markdown.display
        await pilot.press("f2")
        await wait_until(pilot, lambda: markdown.display and not coloured.display)
        assert markdown.source == "**bold** text"
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: coloured.display)


async def test_with_colouring_off_the_answer_streams_as_markdown():
    model = GatedModel([[("# Title\n\n", "draft")], [("some *text*", "target")], [(" more", "draft")]])
    app = make_app(model, colour_origin=False)
    async with app.run_test() as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        await wait_until(pilot, lambda: answers(app))
        markdown = answers(app)[0].query_one(".markdown")
        assert markdown.display and not answers(app)[0].query_one(".coloured").display
        model.release()
        await wait_until(pilot, lambda: markdown.source == "# Title\n\n")
        model.release()
        await wait_until(pilot, lambda: markdown.source == "# Title\n\nsome *text*")
        model.release()
        await wait_until(pilot, lambda: not app.generating)
        assert markdown.source == "# Title\n\nsome *text* more"
        assert "■ draft" not in status(app)


async def test_a_failing_save_does_not_stop_the_chat(data_dir_tmp):
    model = GatedModel(gated=False)
    app = make_app(model)
    async with app.run_test() as pilot:
        await ready(pilot)
        shutil.rmtree(data_dir_tmp / "chats", ignore_errors=True)
        (data_dir_tmp / "chats").write_text("not a directory")  # every save now fails with an OSError
        view = await turn(pilot, "hi")
        assert view.text == "Hello there, world!"
        await pilot.press("ctrl+n")
        await turn(pilot, "again")
