"""The settings dialog of `edgespec chat`: temperature, top-p, max new tokens and K for the next turn.

`parse_settings` is the pure part (strings in, a dict of `Settings` field changes out, or `ValueError`
with a message for the user); `SettingsScreen` is a modal that shows the current values, shows that message
when a value is invalid, and dismisses with the changes only when every value is valid. It does not apply
the changes itself: the app does, for the next turn.
"""

from __future__ import annotations

import math
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from edgespec.policy import MAX_K

MAX_NEW_TOKENS = 32768
FIELDS = ("temperature", "top_p", "max_new_tokens", "k")
LABELS = {"temperature": "Temperature (0 = greedy)", "top_p": "Top-p (0 < p ≤ 1)",
          "max_new_tokens": f"Max new tokens (1..{MAX_NEW_TOKENS})", "k": f"K: auto, or 0..{MAX_K} (0 = plain)"}


def format_value(name: str, value) -> str:
    if name in ("temperature", "top_p"):
        return f"{float(value):g}"
    return str(value)


def parse_settings(values: dict[str, str]) -> dict:
    """Validate the dialog's strings; return the changes as `Settings` fields or raise ValueError."""
    out: dict = {}
    text = values["temperature"].strip()
    try:
        t = float(text)
    except ValueError:
        raise ValueError(f"temperature {text!r} is not a number; use 0 (greedy) or a positive number like 0.7") from None
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature {text!r} must be 0 (greedy) or positive")
    out["temperature"] = t

    text = values["top_p"].strip()
    try:
        p = float(text)
    except ValueError:
        raise ValueError(f"top-p {text!r} is not a number; use a value in (0, 1], 1 = off") from None
    if not (0 < p <= 1):
        raise ValueError(f"top-p {text!r} is out of range; use a value in (0, 1], 1 = off")
    out["top_p"] = p

    text = values["max_new_tokens"].strip()
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"max new tokens {text!r} is not a whole number") from None
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise ValueError(f"max new tokens {text!r} is out of range; use 1..{MAX_NEW_TOKENS}")
    out["max_new_tokens"] = n

    text = values["k"].strip().lower()
    if text == "auto":
        out["k"] = "auto"
    else:
        try:
            k = int(text)
        except ValueError:
            raise ValueError(f"K {values['k'].strip()!r} is neither 'auto' nor a whole number") from None
        if not 0 <= k <= MAX_K:
            raise ValueError(f"K {k} is out of range; use 'auto' or 0..{MAX_K} (0 = no speculation)")
        out["k"] = k
    return out


class SettingsScreen(ModalScreen[dict | None]):
    """Edit the sampling settings; dismisses with the changes, or None when cancelled."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: dict):
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-dialog"):
            yield Label("Settings for the next turn", id="settings-title")
            with Grid(id="settings-grid"):
                for name in FIELDS:
                    yield Label(LABELS[name])
                    yield Input(format_value(name, self.current[name]), id=f"set-{name}")
            yield Static("", id="settings-error")
            with Horizontal(id="settings-buttons"):
                yield Button("Apply", variant="primary", id="settings-apply")
                yield Button("Cancel", id="settings-cancel")

    def values(self) -> dict[str, str]:
        return {name: self.query_one(f"#set-{name}", Input).value for name in FIELDS}

    def apply(self) -> None:
        try:
            changes = parse_settings(self.values())
        except ValueError as err:
            error = self.query_one("#settings-error", Static)
            error.update(str(err))
            error.add_class("shown")
            return
        self.dismiss(changes)

    @on(Button.Pressed, "#settings-apply")
    @on(Input.Submitted)
    def _apply(self) -> None:
        self.apply()

    @on(Button.Pressed, "#settings-cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
