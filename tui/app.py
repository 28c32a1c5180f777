"""`ChatApp`: the Textual app behind `edgespec chat`.

It gets its model, an `edgespec.api.Model`, from a factory run on its model thread (the screen and the input
are up at once; progress lines show while models load), holds the conversation (a `ChatRecord`, saved after
every message and, throttled, while an answer streams), runs each answer on the same model thread, which
streams `Model.chat` and posts `ReplyChunk`/`ReplyDone`/`ReplyFailed` messages, and touches widgets only in
the handlers of those messages, on the UI thread.

One long-lived model thread (not a Textual worker per answer) so that, with `ui_nice`, the UI thread can run
at a lower scheduling priority than everything that generates: the model thread and the inference threads
ONNX Runtime starts from it keep the priority they were created with. On a 2-core machine a redraw that
preempts one of the two inference threads stalls the whole step; at a lower priority the UI draws in the
gaps instead (Linux only: there the nice value is per thread). Escape sets the turn's cancel event; the model ends
the stream after the current round and the partial answer stays, marked "[stopped]".

It does not load models itself, parse command lines, or know the engine: everything it needs from edgespec is
the Python API's `Model.chat(messages, system=, stream=True, cancel=, **sampling settings)` (chunks of text
pieces tagged by origin, with the turn's metrics), `Model.description` and `EdgespecError`; with
`--server` the factory returns an `edgespec.remote.RemoteModel`, the same surface over `edgespec serve`. Nothing of
edgespec but its errors is imported here, so start-up stays fast.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

from edgespec.errors import EdgespecError

from .history import ChatRecord, load_plain_speed, save_chat, save_plain_speed
from .settings import SettingsScreen
from .widgets import (
    AssistantMessage,
    LoadingView,
    Notice,
    PromptInput,
    TurnStats,
    UserMessage,
    format_status,
    merge_runs,
)

DEFAULT_SETTINGS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 512, "k": "auto",
                    "speculation": True, "seed": None}
STOPPED = "[stopped]"

ModelFactory = Callable[[Callable[[str], None]], object]
"""factory(progress) -> edgespec.api.Model; progress(line) may be called from the factory's thread."""


def request_settings(values: dict) -> dict:
    """The app's settings (`DEFAULT_SETTINGS`' names, as the dialog and --max-new-tokens say them) as the keyword
    arguments of `edgespec.api.Model.chat`."""
    request = dict(values)
    request["max_tokens"] = request.pop("max_new_tokens")
    return request


@dataclass
class Turn:
    """One answer in flight: where its text goes in the record and on screen, and how to cancel it."""

    record: ChatRecord
    index: int  # of the assistant message in record.messages
    view: AssistantMessage
    settings: dict  # Model.chat's keyword arguments for this turn (`request_settings`)
    cancel: threading.Event = field(default_factory=threading.Event)
    drawn: threading.Event = field(default_factory=threading.Event)  # the last chunk posted is on screen
    shown: bool = True  # False once the user started a new chat: keep saving, stop drawing
    last_save: float = 0.0


class ModelThread:
    """A daemon thread that runs jobs (loading the model, then each answer) one after another.

    Not a `ThreadPoolExecutor(max_workers=1)`: its worker is not a daemon and is joined at exit, so quitting
    during a first-run download and conversion would wait minutes for it to finish."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="edgespec-model", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


def lower_thread_priority(nice: int) -> bool:
    """Give the calling thread at least nice value `nice` (Linux: per thread). False where unsupported."""
    if nice <= 0 or not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return False
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, min(nice, 19))
    except OSError:
        return False
    return True


class Progress(Message):
    def __init__(self, line: str):
        super().__init__()
        self.line = line


class ModelReady(Message):
    def __init__(self, model):
        super().__init__()
        self.model = model


class ModelFailed(Message):
    def __init__(self, error: str):
        super().__init__()
        self.error = error


class ReplyChunk(Message):
    def __init__(self, turn: Turn, pieces: list, stats: TurnStats | None):
        super().__init__()
        self.turn, self.pieces, self.stats = turn, pieces, stats


class ReplyDone(Message):
    def __init__(self, turn: Turn, pieces: list, stats: TurnStats | None, stop_reason: str | None):
        super().__init__()
        self.turn, self.pieces, self.stats = turn, pieces, stats
        self.stop_reason = stop_reason


class ReplyFailed(Message):
    def __init__(self, turn: Turn, pieces: list, stats: TurnStats | None, error: str):
        super().__init__()
        self.turn, self.pieces, self.stats = turn, pieces, stats
        self.error = error


class ChatApp(App[None]):
    CSS_PATH = Path(__file__).with_name("chat.tcss")  # absolute, so subclasses elsewhere find it
    TITLE = "edgespec chat"
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat", priority=True),
        Binding("f2,ctrl+t", "toggle_colour", "Colours", priority=True),
        Binding("f3,ctrl+s", "toggle_speculation", "Spec on/off", priority=True),
        Binding("f4,ctrl+comma", "settings", "Settings", priority=True),
    ]

    def __init__(self, factory: ModelFactory, *, settings: dict | None = None, system: str | None = None,
                 record: ChatRecord | None = None, warning: str | None = None, colour_origin: bool = True,
                 stream_interval: float = 0.1, save_interval: float = 0.5, ui_nice: int = 0,
                 status_interval: float = 0.25):
        super().__init__()
        self.ui_nice = ui_nice
        self._model_thread: ModelThread | None = None
        self.factory = factory
        self.model = None  # an edgespec.api.Model once the factory returned it
        self.settings_values = {**DEFAULT_SETTINGS, **(settings or {})}
        self.system = system if system is not None else (record.system if record else None)
        self.record = record if record is not None else ChatRecord.new(self.system)
        self.record.system = self.system
        self.colour = colour_origin
        # Every redraw costs the UI thread a few ms, taken from generation on a small machine: the answer is
        # redrawn at most every `stream_interval` s, the status bar's numbers every `status_interval` s.
        self.stream_interval = stream_interval
        self.status_interval = status_interval
        self._status_at = 0.0
        self.save_interval = save_interval
        self._warning = warning
        self._turn: Turn | None = None
        self._queued = False  # a prompt is in the record, waiting for the model to load or a turn to stop
        self._stats: TurnStats | None = None
        self._plain_tps: float | None = None
        self._stoppable = False  # what the footer last showed for Escape
        self._save_failed: str | None = None  # the id of a chat whose save failed (warned once)

    @property
    def generating(self) -> bool:
        """An answer is streaming (or stopping)."""
        return self._turn is not None

    # ---- layout and start-up -------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="conversation"):
            yield LoadingView(id="loading")
        yield PromptInput(id="prompt")
        yield Static(id="status")
        yield Footer()

    async def on_mount(self) -> None:
        prompt = self.query_one(PromptInput)
        prompt.prompts.extend(self.record.user_prompts())
        prompt.focus()
        conversation = self.query_one("#conversation")
        conversation.anchor()
        if self._warning:
            await conversation.mount(Notice(self._warning, "warning"))
        for m in self.record.messages:
            if m["role"] == "user":
                await conversation.mount(UserMessage(m["content"]))
            elif m["role"] == "assistant":
                runs = m.get("pieces") or [[m["content"], "target"]]
                marker = (f"[error] {m['error']}" if m.get("error") else STOPPED if m.get("stopped")
                          else "[interrupted]" if m.get("streaming") else "")
                await conversation.mount(AssistantMessage(runs, colour=self.colour, marker=marker))
        self._refresh_status()
        # The model thread starts (and so keeps) this thread's priority; only then is the UI lowered.
        self._model_thread = ModelThread()
        self._model_thread.submit(self._load_model)
        lower_thread_priority(self.ui_nice)

    def on_unmount(self) -> None:
        if self._turn is not None:
            self._turn.cancel.set()  # the answer in flight ends after its current round
        if self._model_thread is not None:
            self._model_thread.close()

    def _load_model(self) -> None:
        """On the model thread."""
        try:
            model = self.factory(lambda line: self.post_message(Progress(line)))
        except EdgespecError as err:
            self.post_message(ModelFailed(str(err)))
            return
        except Exception as err:  # noqa: BLE001 - show it, don't lose it on a thread nobody joins
            self.post_message(ModelFailed(f"{type(err).__name__}: {err}"))
            return
        self.post_message(ModelReady(model))

    def on_progress(self, message: Progress) -> None:
        for view in self.query(LoadingView):
            view.add_line(message.line)

    def on_model_failed(self, message: ModelFailed) -> None:
        for view in self.query(LoadingView):
            view.query_one("#loading-title", Static).update(f"Could not start: {message.error}")
        self.exit(return_code=2, message=f"edgespec: error: {message.error}")

    async def on_model_ready(self, message: ModelReady) -> None:
        self.model = message.model
        self.record.target, self.record.draft = self._descriptions()
        self._plain_tps = load_plain_speed(self.record.target)
        await self.query(LoadingView).remove()
        self._refresh_status()
        if self._queued:
            self._queued = False
            await self._start_turn()

    # ---- turns ----------------------------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text.strip()
        if not text:
            return
        stopping = self._turn is not None and self._turn.cancel.is_set()
        if self._queued or (self._turn is not None and not stopping):
            self.notify("An answer is still streaming: press Escape to stop it first.", severity="warning")
            return
        prompt = self.query_one(PromptInput)
        prompt.add_prompt(text)
        prompt.clear()
        self.record.messages.append({"role": "user", "content": text})
        self._save(self.record, durable=True)
        await self.query_one("#conversation").mount(UserMessage(text))
        if self.model is None or self._turn is not None:
            self._queued = True
            self._refresh_status()
            return
        await self._start_turn()

    async def _start_turn(self) -> None:
        settings = request_settings(self.settings_values)
        messages = self.record.model_messages()
        view = AssistantMessage(colour=self.colour)
        self.record.messages.append({"role": "assistant", "content": "", "pieces": [], "streaming": True})
        turn = Turn(self.record, len(self.record.messages) - 1, view, settings, last_save=time.monotonic())
        self._turn = turn  # before any await: from here on the app is generating
        self._stats = None
        self._refresh_status()
        await self.query_one("#conversation").mount(view)
        self._model_thread.submit(lambda: self._generate(turn, messages))

    def _generate(self, turn: Turn, messages: list[dict]) -> None:
        """Stream the model's answer on the model thread; post it at most every `stream_interval` seconds."""
        pending: list = []
        stats = None
        reason = None
        notices = 0
        last_post = time.monotonic()
        turn.drawn.set()
        try:
            # closing: the device is handed on even if this loop ends early (a bug, or a model that ignored cancel)
            answer = self.model.chat(messages, system=self.system, stream=True, cancel=turn.cancel, **turn.settings)
            with contextlib.closing(answer):
                for chunk in answer:
                    for notice in chunk.metrics.notices[notices:]:  # e.g. the drafter failed: said once
                        self.notify(notice, title="speculation stopped", severity="warning", timeout=15)  # thread-safe
                    notices = len(chunk.metrics.notices)
                    pending.extend(chunk.pieces)
                    if chunk.metrics.num_emitted_tokens:  # a server's stream has them only in its last chunk
                        stats = TurnStats.from_chunk(chunk, turn.settings["speculation"])
                    reason = chunk.stop_reason
                    if reason is None and turn.cancel.is_set():
                        reason = "cancelled"  # a model that ignores the event still stops here
                    if reason is not None:
                        break
                    now = time.monotonic()
                    # Back-pressure: while the screen has not drawn the last chunk, keep collecting, so a slow
                    # redraw (a long Markdown answer) means fewer, larger updates rather than a growing queue.
                    if now - last_post >= self.stream_interval and turn.drawn.is_set():
                        turn.drawn.clear()
                        self.post_message(ReplyChunk(turn, pending, stats))
                        pending, last_post = [], now
        except EdgespecError as err:
            self.post_message(ReplyFailed(turn, pending, stats, str(err)))
            return
        except Exception as err:  # noqa: BLE001 - a bug must show in the chat, not vanish with the thread
            self.post_message(ReplyFailed(turn, pending, stats, f"{type(err).__name__}: {err}"))
            return
        self.post_message(ReplyDone(turn, pending, stats, reason))

    async def _add(self, message: ReplyChunk | ReplyDone | ReplyFailed) -> None:
        turn = message.turn
        entry = turn.record.messages[turn.index]
        merge_runs(entry["pieces"], message.pieces)
        entry["content"] += "".join(text for text, _ in message.pieces)
        if turn.shown:
            await turn.view.add(message.pieces)
            if message.stats is not None:
                self._stats = message.stats
                now = time.monotonic()
                if not isinstance(message, ReplyChunk) or now - self._status_at >= self.status_interval:
                    self._status_at = now
                    self._refresh_status()

    async def on_reply_chunk(self, message: ReplyChunk) -> None:
        await self._add(message)
        turn = message.turn
        self.call_after_refresh(turn.drawn.set)
        if time.monotonic() - turn.last_save >= self.save_interval:
            self._save(turn.record)
            turn.last_save = time.monotonic()

    async def on_reply_done(self, message: ReplyDone) -> None:
        await self._finish(message)

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        await self._finish(message)

    async def _finish(self, message: ReplyDone | ReplyFailed) -> None:
        await self._add(message)
        turn = message.turn
        entry = turn.record.messages[turn.index]
        entry.pop("streaming", None)
        if isinstance(message, ReplyFailed):
            entry["error"] = message.error
            marker = f"[error] {message.error}"
        elif message.stop_reason == "cancelled":
            entry["stopped"] = True
            marker = STOPPED
        else:
            marker = ""
        self._save(turn.record, durable=True)
        if turn.shown:
            await turn.view.finish(marker)
            if isinstance(message, ReplyFailed):
                turn.view.add_class("failed")
        stats = message.stats
        if (stats is not None and not stats.speculation and stats.decode_tokens_per_s > 0
                and self.model is not None):
            self._plain_tps = stats.decode_tokens_per_s
            try:
                save_plain_speed(self._descriptions()[0], stats.decode_tokens_per_s)
            except OSError:
                pass  # only a convenience for the next session; this one keeps the value in memory
        if self._turn is turn:
            self._turn = None
        self._refresh_status()
        if self._queued and self._turn is None and self.model is not None:
            self._queued = False
            await self._start_turn()

    def _descriptions(self) -> tuple[str, str | None]:
        """The model's target and draft, as the status bar and the saved chat name them."""
        description = self.model.description
        return description["target"], description["draft"]

    def _save(self, record: ChatRecord, *, durable: bool = False) -> None:
        """Save, or say once per chat why not: a full disk must not take the conversation down with it."""
        try:
            save_chat(record, durable=durable)
        except OSError as err:
            if self._save_failed != record.id:
                self._save_failed = record.id
                self.notify(f"could not save the chat ({err}); it goes on unsaved", severity="error", timeout=10)

    # ---- actions --------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("new_chat", "toggle_colour", "toggle_speculation", "settings", "stop"):
            if isinstance(self.screen, ModalScreen):
                return False
            if action == "stop" and (self._turn is None or self._turn.cancel.is_set()):
                return None  # shown dimmed: nothing to stop
        return True

    def action_stop(self) -> None:
        if self._turn is not None and not self._turn.cancel.is_set():
            self._turn.cancel.set()
            self._refresh_status()

    async def action_new_chat(self) -> None:
        if self._turn is not None:
            self._turn.cancel.set()
            self._turn.shown = False
        self._queued = False  # a prompt still waiting stays, unanswered, in the chat it was sent to
        self.record = ChatRecord.new(self.system)
        if self.model is not None:
            self.record.target, self.record.draft = self._descriptions()
        conversation = self.query_one("#conversation")
        await conversation.query(".message, .notice").remove()
        self._stats = None
        self._refresh_status()
        self.query_one(PromptInput).focus()

    async def action_toggle_colour(self) -> None:
        self.colour = not self.colour
        for view in self.query(AssistantMessage):
            await view.set_colour(self.colour)
        self._refresh_status()

    def action_toggle_speculation(self) -> None:
        self.settings_values["speculation"] = not self.settings_values["speculation"]
        self._refresh_status()

    def action_settings(self) -> None:
        self.push_screen(SettingsScreen(dict(self.settings_values)), self._apply_settings)

    def _apply_settings(self, changes: dict | None) -> None:
        if changes:
            self.settings_values.update(changes)
            self._refresh_status()

    # ---- status ---------------------------------------------------------------------------------------

    def _state(self) -> str:
        if self._turn is not None:
            return "stopping…" if self._turn.cancel.is_set() else "generating…  (Esc stops)"
        if self._queued:
            return "waiting for the model…"
        return ""

    def _refresh_status(self) -> None:
        stoppable = self._turn is not None and not self._turn.cancel.is_set()
        if stoppable != self._stoppable:  # the footer recomposes on refresh_bindings: not once per chunk
            self._stoppable = stoppable
            self.refresh_bindings()
        target, draft = self._descriptions() if self.model is not None else (None, None)
        # The status bar has a fixed height: redraw it without a layout pass of the whole screen.
        self.query_one("#status", Static).update(format_status(
            target=target, draft=draft,
            speculation=self.settings_values["speculation"], k_setting=self.settings_values["k"],
            stats=self._stats, plain_tps=self._plain_tps, colour=self.colour, state=self._state()), layout=False)
