"""Where progress goes: stderr by default, or a callback a front end installs (the TUI's loading view).

Long one-off work (downloads, conversions) reports through `report` (one line) and `bar` (one progress bar per
download or conversion, with sizes and an estimate of the time left). `reporting_to(callback)` routes both for
the duration of a block, in the current thread/context only: a bar's redraws reach the callback as `BarLine`s,
which a front end shows in place of that bar's previous line. `cache_notice` says once per process where the
cache is. Nothing here decides what to report.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path


def _to_stderr(line: str) -> None:
    print(f"edgespec: {line}", file=sys.stderr, flush=True)


_sink: ContextVar[Callable[[str], None]] = ContextVar("edgespec_progress", default=_to_stderr)
_told: set[str] = set()  # the cache notices already given in this process
_keys = itertools.count(1)
# What a bar shows outside a terminal: sizes, the time so far and the estimate of the time left, the rate.
SINK_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed} so far, about {remaining} left, {rate_fmt}]"


def report(line: str) -> None:
    _sink.get()(line)


@contextlib.contextmanager
def reporting_to(callback: Callable[[str], None]) -> Iterator[None]:
    token = _sink.set(callback)
    try:
        yield
    finally:
        _sink.reset(token)


class BarLine(str):
    """A progress bar's current state as one line; `key` names the bar, so a front end replaces its last line."""

    key: int

    def __new__(cls, text: str, key: int) -> BarLine:
        line = super().__new__(cls, text)
        line.key = key
        return line


class _SinkFile:
    """The file a bar writes to when a front end has the sink: each redraw becomes one `BarLine`."""

    def __init__(self, sink: Callable[[str], None]):
        self.sink, self.key = sink, next(_keys)

    def write(self, text: str) -> None:
        text = text.replace("\r", "\n").strip().rsplit("\n", 1)[-1].strip()
        if text:
            self.sink(BarLine(text, self.key))

    def flush(self) -> None:
        pass


def bar(total: float | None, label: str, *, unit: str = "B", enabled: bool = True, tty_only: bool = False,
        **kwargs):
    """One tqdm bar for `label`: on stderr (`tty_only`: only when stderr is a terminal), or, under
    `reporting_to`, as `BarLine`s to the front end (a redraw every half second at most). `unit` "B" shows sizes
    in KiB/MiB/GiB; `kwargs` go to tqdm (e.g. `iterable`, `initial`)."""
    from tqdm import tqdm

    sink = _sink.get()
    size = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    if sink is _to_stderr:
        return tqdm(total=total, desc=label, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                    disable=None if tty_only and enabled else not enabled, **size, **kwargs)
    if total is None:
        shown = "{desc}: {n_fmt}" + ("B" if unit == "B" else f" {unit}s") + " [{elapsed} so far, {rate_fmt}]"
    else:  # a total of 0 may be set later (a download learns its size as it starts)
        shown = SINK_FORMAT.replace("{total_fmt}", "{total_fmt}" + ("B" if unit == "B" else f" {unit}s"))
    return tqdm(total=total, desc=label, unit=unit, file=_SinkFile(sink), leave=True, mininterval=0.5,
                bar_format=shown, disable=not enabled, **size, **kwargs)


def cache_notice(where: Path, what: str = "edgespec's cache") -> None:
    """Once per process and place, before the first download or conversion writes there: where that is, and
    how to move or free it."""
    key = str(where)
    if key in _told:
        return
    _told.add(key)
    if what == "edgespec's cache":
        report(f"first start: models are downloaded and converted once, into {where} (EDGESPEC_CACHE moves it; "
               "`edgespec models` lists what is there and frees it); later starts take seconds")
    else:
        report(f"downloading into {what} at {where} (HF_HOME or HF_HUB_CACHE move it)")
