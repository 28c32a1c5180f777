"""Saved chats: atomic saves while streaming, resume, --list, and corrupt files left untouched."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest
from fakes import GatedSession, fixed_factory, wait_until

import tui.app
from edgespec.cli import main
from tui.app import ChatApp
from tui.history import (
    ChatRecord,
    CorruptChat,
    chats_dir,
    latest_chat_id,
    list_chats,
    load_chat,
    load_plain_speed,
    save_chat,
    save_plain_speed,
)
from tui.widgets import AssistantMessage, Notice, UserMessage


def test_save_and_load_round_trip_leaves_no_temp_files():
    rec = ChatRecord.new(system="sys")
    rec.messages += [{"role": "user", "content": "héllo"},
                     {"role": "assistant", "content": "hi", "pieces": [["h", "draft"], ["i", "target"]]}]
    path = save_chat(rec, durable=True)
    assert path == chats_dir() / f"{rec.id}.json"
    back = load_chat(rec.id)
    assert back.messages == rec.messages and back.system == "sys"
    assert back.model_messages() == [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]
    assert [p.name for p in chats_dir().iterdir()] == [path.name]


@pytest.mark.parametrize("content", ['{"id": "x", "messages": [{"role": "us', "", "[1, 2]",
                                     '{"id": "x", "messages": [{"role": "user"}]}'])
def test_corrupt_files_raise_corrupt_chat(content):
    (chats_dir() / "bad.json").write_text(content)
    with pytest.raises(CorruptChat):
        load_chat("bad")
    [summary] = list_chats()
    assert summary.id == "bad" and summary.error


def test_plain_speed_is_remembered_per_target():
    assert load_plain_speed("t") is None
    save_plain_speed("t", 12.5)
    save_plain_speed("u", 3.0)
    assert load_plain_speed("t") == 12.5 and load_plain_speed("u") == 3.0


@pytest.mark.asyncio
async def test_the_chat_is_saved_while_streaming_and_at_the_end():
    session = GatedSession()
    app = ChatApp(fixed_factory(session), stream_interval=0, save_interval=0)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.session is not None)
        app.query_one("#prompt").insert("hi")
        await pilot.press("enter")
        path = chats_dir() / f"{app.record.id}.json"
        await wait_until(pilot, lambda: path.exists())
        assert json.loads(path.read_text())["messages"] == [{"role": "user", "content": "hi"}]
        session.release()
        # mid-answer: what is on screen is already on disk, marked as streaming
        await wait_until(pilot, lambda: json.loads(path.read_text())["messages"][-1].get("content") == "Hello there")
        assert json.loads(path.read_text())["messages"][-1]["streaming"] is True
        session.release(2)
        await wait_until(pilot, lambda: not app.generating)
        saved = json.loads(path.read_text())
        assert saved["messages"][-1]["content"] == "Hello there, world!" and "streaming" not in saved["messages"][-1]
        assert saved["target"] == "fake-target" and saved["draft"] == "fake-draft"


@pytest.mark.asyncio
async def test_resume_shows_the_chat_and_continues_it():
    rec = ChatRecord.new(system="be nice")
    rec.messages += [{"role": "user", "content": "old question"},
                     {"role": "assistant", "content": "old answer", "pieces": [["old ", "draft"], ["answer", "target"]]},
                     {"role": "user", "content": "cut"},
                     {"role": "assistant", "content": "cut sho", "streaming": True, "pieces": [["cut sho", "target"]]}]
    save_chat(rec)
    session = GatedSession(gated=False)
    app = ChatApp(fixed_factory(session), record=load_chat(rec.id), stream_interval=0)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.session is not None)
        assert [m.text for m in app.query(UserMessage)] == ["old question", "cut"]
        views = list(app.query(AssistantMessage))
        assert [v.text for v in views] == ["old answer", "cut sho"]
        assert views[0].runs == [["old ", "draft"], ["answer", "target"]]
        assert views[1].marker == "[interrupted]"
        app.query_one("#prompt").insert("new")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.query(AssistantMessage)) == 3 and not app.generating)
        assert session.calls[0]["system"] == "be nice"
        assert session.calls[0]["messages"][-1] == {"role": "user", "content": "new"}
        assert len(session.calls[0]["messages"]) == 5
        await pilot.press("up")
        assert app.query_one("#prompt").text == "new"
    assert len(load_chat(rec.id).messages) == 6
    assert latest_chat_id() == rec.id


def test_list_prints_id_date_and_first_message(capsys):
    rec = ChatRecord.new()
    rec.messages.append({"role": "user", "content": "what is\nK?"})
    save_chat(rec)
    (chats_dir() / "broken.json").write_text("{")
    assert main(["chat", "--list"]) == 0
    out = capsys.readouterr().out
    assert f"{rec.id}  " in out and "what is K?" in out
    assert "broken" in out and "unreadable" in out


class CapturedApp:
    """Stands in for ChatApp in cmd_chat: records how it was built, runs nothing."""

    built: ClassVar[dict] = {}

    def __init__(self, factory, **kwargs):
        CapturedApp.built = kwargs
        self.return_code = 0

    def run(self):
        pass


def test_resume_without_id_takes_the_latest(monkeypatch):
    first, second = ChatRecord.new(), ChatRecord.new()
    save_chat(first)
    save_chat(second)
    monkeypatch.setattr(tui.app, "ChatApp", CapturedApp)
    assert main(["chat", "--resume"]) == 0
    assert CapturedApp.built["record"].id == latest_chat_id()
    assert main(["chat", "--resume", first.id]) == 0
    assert CapturedApp.built["record"].id == first.id
    assert main(["chat", "--resume", "nope"]) == 2


@pytest.mark.asyncio
async def test_a_corrupt_chat_gives_a_warning_and_is_never_overwritten(monkeypatch):
    bad = chats_dir() / "20200101-000000-dead.json"
    bad.write_text('{"id": "20200101-000000-dead", "messages": [{"role": "user", "content": "trunc')
    before = bad.read_bytes()
    monkeypatch.setattr(tui.app, "ChatApp", CapturedApp)
    assert main(["chat", "--resume", "20200101-000000-dead"]) == 0
    built = CapturedApp.built
    assert built["record"] is None and "cannot be read" in built["warning"]
    monkeypatch.undo()

    session = GatedSession(gated=False)
    app = ChatApp(fixed_factory(session), record=built["record"], warning=built["warning"], stream_interval=0)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.session is not None)
        [notice] = app.query(Notice)
        assert notice.kind == "warning" and "left untouched" in notice.text
        app.query_one("#prompt").insert("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.query(AssistantMessage) and not app.generating)
        assert app.record.id != "20200101-000000-dead"
    assert bad.read_bytes() == before
    assert (chats_dir() / f"{app.record.id}.json").exists()
