"""The widgets of `edgespec chat`: the prompt input, the two kinds of message, the status bar.

`AssistantMessage` keeps the answer as runs of (text, origin) and shows it one of two ways: coloured by
origin (text accepted from the draft in `DRAFT_STYLE`, the target's own tokens in the default colour) as a
`rich.text.Text`, or, with colouring off, as Markdown streamed through Textual's `MarkdownStream`. Markdown
rendering would lose the per-token colours, so the two are alternatives, switched with a key. All methods
here run on the UI thread; none of them knows about the engine or workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea
from textual.widgets.markdown import MarkdownStream

DRAFT = "draft"
TARGET = "target"
DRAFT_STYLE = "#3fb7c9"
NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")
RESERVE_LINES = 4  # spare lines below a streaming answer's last line: one layout per this many new lines


def merge_runs(runs: list[list], pieces) -> None:
    """Append (text, origin) pieces to `runs`, joining neighbours of the same origin (what gets saved)."""
    for text, origin in pieces:
        if not text:
            continue
        if runs and runs[-1][1] == origin:
            runs[-1][0] += text
        else:
            runs.append([text, origin])


class PromptInput(TextArea):
    """A multi-line input: Enter sends, Shift+Enter (or Ctrl+J) adds a line, Up on the first line and
    Down on the last walk through earlier prompts."""

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.prompts: list[str] = []
        self._index: int | None = None  # position in history while walking; None = editing a new prompt
        self._draft = ""

    def add_prompt(self, prompt: str) -> None:
        if prompt and (not self.prompts or self.prompts[-1] != prompt):
            self.prompts.append(prompt)
        self._index = None

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    def _walk(self, step: int) -> bool:
        if not self.prompts:
            return False
        index = len(self.prompts) if self._index is None else self._index
        new = index + step
        if new < 0 or (new > len(self.prompts)) or (new == len(self.prompts) and self._index is None):
            return False
        if self._index is None:
            self._draft = self.text
        self._index = None if new == len(self.prompts) else new
        self.load_text(self._draft if self._index is None else self.prompts[new])
        self.move_cursor(self.document.end)
        return True

    def action_cursor_up(self, select: bool = False) -> None:
        if select or not self.cursor_at_first_line or not self._walk(-1):
            super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if select or not self.cursor_at_last_line or not self._walk(+1):
            super().action_cursor_down(select)


class UserMessage(Static):
    def __init__(self, text: str):
        super().__init__(Text(text), classes="message user")
        self.text = text


class Notice(Static):
    """A line in the conversation that is not a message: a warning or an error."""

    def __init__(self, text: str, kind: str = "warning"):
        super().__init__(Text(text), classes=f"notice {kind}")
        self.text = text
        self.kind = kind


def cut_block(tail: Text, limit: int = 400) -> tuple[Text, Text] | None:
    """Split a long coloured tail at its last newline into (finished block, new tail), or None.

    The newline at the cut is dropped: stacking the two blocks puts the line break back. Cutting keeps
    each redraw while streaming to the last few lines instead of re-wrapping the whole answer."""
    if len(tail) <= limit:
        return None
    cut = tail.plain.rfind("\n")
    if cut <= 0:
        return None
    return tail[:cut], tail[cut + 1:]


class AssistantMessage(Vertical):
    """One answer, streamed in. `add` appends pieces; `finish` ends the stream and shows a marker."""

    def __init__(self, runs: list[list] | None = None, *, colour: bool = True, marker: str = ""):
        super().__init__(classes="message assistant")
        self.runs: list[list] = []
        self.colour = colour
        self._tail = Text()  # the coloured text after the last finished block
        self._tail_view: Static | None = None
        self._tail_height = 0  # lines reserved for the tail while streaming (0 = auto height)
        self._md_stream: MarkdownStream | None = None
        self._md_len = 0  # characters of the answer already in the Markdown widget
        self._initial = runs or []
        self._marker = marker

    def compose(self) -> ComposeResult:
        yield Vertical(classes="coloured")
        yield Markdown(classes="markdown")
        yield Static(Text(self._marker), classes="marker")

    async def on_mount(self) -> None:
        self.query_one(".marker").display = bool(self._marker)
        await self.set_colour(self.colour)
        if self._initial:
            await self.add([tuple(r) for r in self._initial])
            await self.finish(self._marker)

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.runs)

    @property
    def marker(self) -> str:
        """"" while streaming or after a normal end; "[stopped]", "[error] ..." or "[interrupted]" otherwise."""
        return self._marker

    async def add(self, pieces) -> None:
        merge_runs(self.runs, pieces)
        if self.colour:
            for text, origin in pieces:
                self._tail.append(text, style=DRAFT_STYLE if origin == DRAFT else None)
            await self._show_tail()
        else:
            await self._sync_markdown()

    async def _show_tail(self) -> None:
        cut = cut_block(self._tail)
        if cut is not None:
            head, self._tail = cut
            self._tail_view.update(head)
            self._release_height()
            self._tail_view = Static(self._tail, classes="block")
            await self.query_one(".coloured").mount(self._tail_view)
        else:
            # A layout pass re-arranges the whole screen (16 ms a pass, measured: most of the UI thread's time
            # while streaming). The tail gets a fixed height with a few spare lines, so new tokens only repaint
            # it; a layout happens when the text outgrows the reserve, every RESERVE_LINES lines or so.
            lines = self._wrapped_lines(self._tail)
            if lines == 0:  # width not known yet: let the layout size it
                self._tail_view.update(self._tail)
            elif lines > self._tail_height:
                self._tail_height = lines + RESERVE_LINES
                self._tail_view.styles.height = self._tail_height
                self._tail_view.update(self._tail, layout=False)
            else:
                self._tail_view.update(self._tail, layout=False)

    def _release_height(self) -> None:
        """Back to the tail's own height (no spare lines): the answer ended, or the tail became a block."""
        if self._tail_view is not None and self._tail_height:
            self._tail_view.styles.height = "auto"
        self._tail_height = 0

    def _wrapped_lines(self, text: Text) -> int:
        """Lines `text` takes in the tail view at its current width; 0 (= unknown: lay out) before the first
        layout."""
        width = self._tail_view.content_region.width if self._tail_view is not None else 0
        if width <= 0:
            return 0
        return len(text.wrap(self.app.console, width))

    async def _rebuild_coloured(self) -> None:
        box = self.query_one(".coloured")
        await box.remove_children()
        self._tail = Text()
        self._tail_view = Static(self._tail, classes="block")
        self._tail_height = 0
        await box.mount(self._tail_view)
        for text, origin in self.runs:
            self._tail.append(text, style=DRAFT_STYLE if origin == DRAFT else None)
        await self._show_tail()

    async def _sync_markdown(self) -> None:
        text = self.text
        if len(text) == self._md_len:
            return
        if self._md_stream is None:
            self._md_stream = Markdown.get_stream(self.query_one(".markdown", Markdown))
        await self._md_stream.write(text[self._md_len:])
        self._md_len = len(text)

    async def _stop_stream(self) -> None:
        if self._md_stream is not None:
            await self._md_stream.stop()
            self._md_stream = None

    async def finish(self, marker: str = "") -> None:
        self._release_height()
        if not self.colour:
            await self._sync_markdown()
        await self._stop_stream()
        self._marker = marker
        label = self.query_one(".marker", Static)
        label.update(Text(marker))
        label.display = bool(marker)

    async def set_colour(self, colour: bool) -> None:
        self.colour = colour
        coloured = self.query_one(".coloured")
        markdown = self.query_one(".markdown", Markdown)
        await self._stop_stream()
        if colour:
            await self._rebuild_coloured()
        else:
            await markdown.update(self.text)
            self._md_len = len(self.text)
        coloured.display = colour
        markdown.display = not colour


class LoadingView(Vertical):
    """What the screen shows while the models load: a title and the factory's progress lines, wrapped at the
    window's edge (a warning is read whole). A progress bar's line (`edgespec.progress.BarLine`) is redrawn in
    place: one line per download or conversion."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lines: list[str] = []
        self._bar_rows: dict[int, int] = {}  # a bar's key -> its row in `lines`

    def compose(self) -> ComposeResult:
        yield Static("Loading the models…", id="loading-title")
        with VerticalScroll(id="loading-scroll"):
            yield Static("", id="loading-log")

    def add_line(self, line: str) -> None:
        key = getattr(line, "key", None)
        if key in self._bar_rows:
            self.lines[self._bar_rows[key]] = str(line)
        else:
            if key is not None:
                self._bar_rows[key] = len(self.lines)
            self.lines.append(str(line))
        self.query_one("#loading-log", Static).update(Text("\n".join(self.lines)))
        self.query_one("#loading-scroll", VerticalScroll).scroll_end(animate=False)


@dataclass(frozen=True)
class TurnStats:
    """The numbers the status bar shows, copied out of the session's metrics in the worker thread."""

    k: int
    speculation: bool
    tokens: int
    tokens_per_s: float
    decode_tokens_per_s: float
    acceptance_rate: float
    tau: float
    num_draft_tokens: int

    @classmethod
    def from_chunk(cls, chunk, speculation: bool) -> TurnStats:
        m = chunk.metrics
        return cls(chunk.k, speculation, m.num_emitted_tokens, m.tokens_per_s, m.decode_tokens_per_s,
                   m.acceptance_rate, m.tau, m.num_draft_tokens)


def format_status(*, target: str | None, draft: str | None, speculation: bool, k_setting, stats: TurnStats | None,
                  plain_tps: float | None, colour: bool, state: str = "") -> Text:
    """The two status lines: the models and mode, then this turn's numbers and the speedup over plain."""
    line1 = Text()
    line1.append("target ", style="dim")
    line1.append(target or "loading…", style="bold")
    line1.append("  draft ", style="dim")
    line1.append(draft or "none", style=f"bold {DRAFT_STYLE}" if colour else "bold")
    line1.append("  speculation ", style="dim")
    line1.append("on" if speculation else "off (plain)", style="bold" if speculation else "bold yellow")
    if state:
        line1.append(f"  {state}", style="italic")

    line2 = Text()
    k_text = str(stats.k) if stats is not None and stats.speculation else ("0" if not speculation else str(k_setting))
    if stats is not None and stats.speculation and k_setting == "auto":
        k_text += " (auto)"
    line2.append("K ", style="dim")
    line2.append(k_text)
    if stats is None:
        line2.append("   tok/s —   acceptance —   τ —")
    else:
        line2.append(f"   {stats.decode_tokens_per_s:.1f} tok/s")
        acc = f"{stats.acceptance_rate:.2f}" if stats.num_draft_tokens else "—"
        line2.append(f"   acceptance {acc}   τ {stats.tau:.2f}")
    line2.append("   speedup ")
    if stats is not None and stats.speculation and plain_tps and stats.decode_tokens_per_s > 0:
        line2.append(f"×{stats.decode_tokens_per_s / plain_tps:.2f} vs plain", style="bold")
    else:
        line2.append("—")
    if colour:
        line2.append("   ")
        line2.append("■ draft", style=DRAFT_STYLE)
        line2.append(" ■ target")
    return Text("\n").join([line1, line2])
