"""Saved chats: atomic saves while streaming, resume, --list, and corrupt files left untouched."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar

import pytest
from fakes import GatedModel, fixed_factory, wait_until

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
    model = GatedModel()
    app = ChatApp(fixed_factory(model), stream_interval=0, save_interval=0)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.model is not None)
        app.query_one("#prompt").insert("hi")
        await pilot.press("enter")
        path = chats_dir() / f"{app.record.id}.json"
        await wait_until(pilot, lambda: path.exists())
        assert json.loads(path.read_text())["messages"] == [{"role": "user", "content": "hi"}]
        model.release()
        # mid-answer: what is on screen is already on disk, marked as streaming
        await wait_until(pilot, lambda: json.loads(path.read_text())["messages"][-1].get("content") == "Hello there")
        assert json.loads(path.read_text())["messages"][-1]["streaming"] is True
        model.release(2)
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
    model = GatedModel(gated=False)
    app = ChatApp(fixed_factory(model), record=load_chat(rec.id), stream_interval=0)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.model is not None)
        assert [m.text for m in app.query(UserMessage)] == ["old question", "cut"]
        views = list(app.query(AssistantMessage))
        assert [v.text for v in views] == ["old answer", "cut sho"]
        assert views[0].runs == [["old ", "draft"], ["answer", "target"]]
        assert views[1].marker == "[interrupted]"
        app.query_one("#prompt").insert("new")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.query(AssistantMessage)) == 3 and not app.generating)
        assert model.calls[0]["system"] == "be nice"
        assert model.calls[0]["messages"][-1] == {"role": "user", "content": "new"}
        assert len(model.calls[0]["messages"]) == 5
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


def saved_at(record: ChatRecord, mtime: int) -> Path:
    """Save `record` as if last written at `mtime` (seconds since the epoch)."""
    path = save_chat(record)
    os.utime(path, (mtime, mtime))
    return path


def test_resume_without_id_takes_the_most_recently_written(monkeypatch, capsys):
    # The latest is the one written last, whatever the ids say: here the older chat has the later name.
    newest, older = ChatRecord(id="20240101-000000-aaaa"), ChatRecord(id="20240101-000000-zzzz")
    oldest = ChatRecord.new()
    saved_at(oldest, 1_000_000_000)
    saved_at(newest, 1_700_000_200)
    saved_at(older, 1_700_000_100)
    assert latest_chat_id() == newest.id
    monkeypatch.setattr(tui.app, "ChatApp", CapturedApp)
    assert main(["chat", "--resume"]) == 0
    assert CapturedApp.built["record"].id == newest.id and CapturedApp.built["warning"] is None
    assert main(["chat", "--resume", oldest.id]) == 0
    assert CapturedApp.built["record"].id == oldest.id
    capsys.readouterr()
    assert main(["chat", "--resume", "nope"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("edgespec: error: there is no saved chat 'nope'")


def test_resume_without_id_and_nothing_saved_starts_a_new_chat_with_a_note(monkeypatch):
    monkeypatch.setattr(tui.app, "ChatApp", CapturedApp)
    assert main(["chat", "--resume"]) == 0
    assert CapturedApp.built["record"] is None and "no saved chat" in CapturedApp.built["warning"]


@pytest.mark.parametrize("chat_id", ["../x", "../../etc/passwd", "/etc/passwd", "a/b", "..\\x", ".hidden", "..",
                                     "a" * 300, "nul\0byte"])
def test_a_chat_id_naming_anything_outside_the_chats_folder_is_a_one_line_error(chat_id, monkeypatch, capsys,
                                                                                data_dir_tmp):
    # a file where `../x` would lead: it must not be read
    chats_dir()  # makes the data dir
    (data_dir_tmp / "x.json").write_text(json.dumps({"id": "x", "messages": []}))
    monkeypatch.setattr(tui.app, "ChatApp", CapturedApp)
    CapturedApp.built = {}
    assert main(["chat", "--resume", chat_id]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("edgespec: error: ") and "not a chat id" in err[0], err
    assert CapturedApp.built == {}  # the app never started


def test_resume_of_a_corrupt_latest_chat_warns_and_leaves_it_untouched(monkeypatch):
    good = ChatRecord.new()
    good.messages.append({"role": "user", "content": "older, fine"})
    saved_at(good, 1_700_000_000)
    bad = chats_dir() / "20240101-000000-bad0.json"
    bad.write_bytes(b'{"id": "20240101-000000-bad0", "messages": [{"role": "us')
    os.utime(bad, (1_700_000_100, 1_700_000_100))
    before = bad.read_bytes()
    monkeypatch.setattr(tui.app, "ChatApp", CapturedApp)
    assert main(["chat", "--resume"]) == 0
    built = CapturedApp.built
    assert built["record"] is None  # not the older chat in its place: the user asked for the latest
    assert "20240101-000000-bad0" in built["warning"] and "cannot be read" in built["warning"]
    assert bad.read_bytes() == before


@pytest.mark.parametrize("content", [b"", b"{", b"[1, 2]", b'"text"', b"null", b'{"t": "fast"}', b'{"t": -3}',
                                     b'{"t": 0}', b'{"t": Infinity}', b'{"t": NaN}', b'{"t": true}', b"\xff\xfe\x00"])
def test_a_corrupt_plain_speed_file_is_ignored_and_replaced_on_the_next_save(content, data_dir_tmp):
    data_dir_tmp.mkdir(parents=True, exist_ok=True)
    (data_dir_tmp / "plain_speed.json").write_bytes(content)
    assert load_plain_speed("t") is None
    save_plain_speed("t", 7.5)
    assert load_plain_speed("t") == 7.5


def test_a_plain_speed_path_that_is_a_folder_reads_as_none_and_fails_to_save_with_an_oserror(data_dir_tmp):
    (data_dir_tmp / "plain_speed.json").mkdir(parents=True)
    assert load_plain_speed("t") is None
    with pytest.raises(OSError):  # what the app catches (the speed is only a convenience)
        save_plain_speed("t", 7.5)
    assert [p.name for p in data_dir_tmp.iterdir()] == ["plain_speed.json"]  # no temp file left behind


@pytest.mark.parametrize("failure", ["write", "replace"])
def test_a_failed_save_keeps_the_old_file_and_leaves_no_temp_file(failure, monkeypatch):
    rec = ChatRecord.new()
    rec.messages.append({"role": "user", "content": "kept"})
    path = save_chat(rec)
    before = path.read_bytes()
    rec.messages.append({"role": "assistant", "content": "lost"})

    def dump(data, f, **kwargs):  # the disk fills up halfway through the JSON
        f.write('{"id": "half')
        f.flush()
        raise OSError(28, "No space left on device")

    def replace(src, dst):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as patch, pytest.raises(OSError):
        if failure == "write":
            patch.setattr(json, "dump", dump)
        else:
            patch.setattr(os, "replace", replace)
        save_chat(rec, durable=True)
    assert path.read_bytes() == before
    assert [p.name for p in chats_dir().iterdir()] == [path.name]
    assert load_chat(rec.id).messages == [{"role": "user", "content": "kept"}]


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

    model = GatedModel(gated=False)
    app = ChatApp(fixed_factory(model), record=built["record"], warning=built["warning"], stream_interval=0)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.model is not None)
        [notice] = app.query(Notice)
        assert notice.kind == "warning" and "left untouched" in notice.text
        app.query_one("#prompt").insert("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.query(AssistantMessage) and not app.generating)
        assert app.record.id != "20200101-000000-dead"
    assert bad.read_bytes() == before
    assert (chats_dir() / f"{app.record.id}.json").exists()
