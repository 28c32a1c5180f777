"""Saved chats: one JSON file per chat in `data_dir()/chats/<id>.json`, written atomically.

A chat is saved after every message and, throttled by the app, while an answer streams, so killing the app
loses at most the last fraction of a second of text. Every write goes to a temporary file in the same
directory and is renamed over the old one (`os.replace`), so a reader never sees half a file. A file that
cannot be read is reported as `CorruptChat` and is never written to again: the caller starts a new chat under
a new id. The remembered plain-decoding speed (the A/B baseline for "speedup vs plain") lives here too.

This module knows nothing about Textual, the engine or the models; it moves dicts to and from disk.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.paths import data_dir

FORMAT_VERSION = 1


class CorruptChat(Exception):
    """A chat file exists but cannot be read (truncated, not JSON, wrong shape)."""

    def __init__(self, path: Path, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path.name}: {reason}")


def chats_dir() -> Path:
    root = data_dir() / "chats"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def new_chat_id() -> str:
    """A fresh id that sorts by creation time and names no existing file (a corrupt one included)."""
    root = data_dir() / "chats"  # not chats_dir(): an id must be had even where the directory cannot be made
    while True:
        chat_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        if not (root / f"{chat_id}.json").exists():
            return chat_id


@dataclass
class ChatRecord:
    """One conversation. `messages` are {"role", "content"} dicts; assistant ones may carry extras:
    "pieces" (runs of [text, "draft"|"target"]), "stopped" (cancelled by the user), "error"."""

    id: str
    system: str | None = None
    target: str | None = None
    draft: str | None = None
    created: str = field(default_factory=_now)
    updated: str = field(default_factory=_now)
    messages: list[dict] = field(default_factory=list)

    @classmethod
    def new(cls, system: str | None = None) -> ChatRecord:
        return cls(id=new_chat_id(), system=system)

    def model_messages(self) -> list[dict]:
        """The history as the model sees it: role and content only."""
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def user_prompts(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]

    def first_user_message(self) -> str:
        prompts = self.user_prompts()
        return prompts[0] if prompts else ""

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "id": self.id, "created": self.created, "updated": self.updated,
                "system": self.system, "target": self.target, "draft": self.draft, "messages": self.messages}

    @classmethod
    def from_dict(cls, data: dict, path: Path) -> ChatRecord:
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list) or not isinstance(data.get("id"), str):
            raise CorruptChat(path, "not an edgespec chat (no id or messages)")
        for m in data["messages"]:
            if not (isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
                    and isinstance(m.get("content"), str)):
                raise CorruptChat(path, "a message without a role or text")
        return cls(id=data["id"], system=data.get("system"), target=data.get("target"), draft=data.get("draft"),
                   created=data.get("created") or _now(), updated=data.get("updated") or _now(),
                   messages=data["messages"])


def _atomic_write_json(path: Path, data: dict, *, durable: bool) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=1)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_chat(record: ChatRecord, *, durable: bool = False) -> Path:
    """Write `record` to its file atomically. `durable` also fsyncs (at the end of an answer; the
    throttled saves while streaming skip it, a killed process keeps the page cache anyway)."""
    record.updated = _now()
    path = chats_dir() / f"{record.id}.json"
    _atomic_write_json(path, record.to_dict(), durable=durable)
    return path


def chat_path(chat_id: str) -> Path:
    """Where chat `chat_id` lives; an id that names anything outside the chats folder (`../x`, `/etc/x`, a hidden
    file) is an `EdgespecError`."""
    if not chat_id or "/" in chat_id or "\\" in chat_id or chat_id.startswith(".") or "\0" in chat_id:
        raise EdgespecError(f"{chat_id[:60]!r} is not a chat id; see `edgespec chat --list`")
    return chats_dir() / f"{chat_id}.json"


def load_chat(chat_id: str) -> ChatRecord:
    """The saved chat `chat_id`; `EdgespecError` if there is none, `CorruptChat` if it cannot be read."""
    path = chat_path(chat_id)
    try:
        found = path.is_file()
    except OSError as err:  # a name the file system refuses (too long, say)
        raise EdgespecError(f"{chat_id[:60]!r} is not a chat id ({err.strerror}); "
                            "see `edgespec chat --list`") from None
    if not found:
        raise EdgespecError(f"there is no saved chat {chat_id!r}; see `edgespec chat --list` for the ids")
    return read_chat_file(path)


def read_chat_file(path: Path) -> ChatRecord:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptChat(path, f"unreadable ({type(err).__name__}: {err})") from err
    return ChatRecord.from_dict(data, path)


def chat_files() -> list[Path]:
    """Saved chat files, most recently written last."""
    return sorted(chats_dir().glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))


def latest_chat_id() -> str | None:
    files = chat_files()
    return files[-1].stem if files else None


@dataclass
class ChatSummary:
    id: str
    date: str
    first_message: str
    error: str | None = None


def list_chats() -> list[ChatSummary]:
    """One summary per saved chat, oldest first; unreadable files are listed with their error."""
    out = []
    for path in chat_files():
        try:
            rec = read_chat_file(path)
        except CorruptChat as err:
            date = datetime.fromtimestamp(path.stat().st_mtime).astimezone().isoformat(timespec="seconds")
            out.append(ChatSummary(path.stem, date, "", error=err.reason))
            continue
        out.append(ChatSummary(rec.id, rec.updated, rec.first_user_message()))
    return out


def format_chat_list(summaries: list[ChatSummary], width: int = 60) -> str:
    if not summaries:
        return "no saved chats yet (start one with `edgespec chat`)"
    lines = []
    for s in summaries:
        first = " ".join(s.first_message.split())
        if len(first) > width:
            first = first[: width - 1] + "…"
        text = f"[unreadable: {s.error}]" if s.error else (first or "(empty)")
        lines.append(f"{s.id}  {s.date[:19].replace('T', ' ')}  {text}")
    return "\n".join(lines)


# The A/B baseline: the last decode tokens/s measured with speculation off, per target model. Kept on disk
# so a later session on the same models can show a speedup before the user toggles again.

def _speeds_path() -> Path:
    return data_dir() / "plain_speed.json"


def load_plain_speed(target: str) -> float | None:
    try:
        data = json.loads(_speeds_path().read_text(encoding="utf-8"))
        value = data.get(target)
    except (OSError, ValueError, AttributeError):
        return None
    # a hand-edited or damaged file may hold anything: only a finite positive number is a speed
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return float(value) if ok else None


def save_plain_speed(target: str, tokens_per_s: float) -> None:
    path = _speeds_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[target] = tokens_per_s
    _atomic_write_json(path, data, durable=False)
