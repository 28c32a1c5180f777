"""Where progress lines go: stderr by default, or a callback a front end installs (the TUI's loading view).

Long one-off work (downloads, conversions) reports through `report`; `reporting_to(callback)` routes those
lines for the duration of a block, in the current thread/context only. Nothing here decides what to report.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar


def _to_stderr(line: str) -> None:
    print(f"edgespec: {line}", file=sys.stderr, flush=True)


_sink: ContextVar[Callable[[str], None]] = ContextVar("edgespec_progress", default=_to_stderr)


def report(line: str) -> None:
    _sink.get()(line)


@contextlib.contextmanager
def reporting_to(callback: Callable[[str], None]) -> Iterator[None]:
    token = _sink.set(callback)
    try:
        yield
    finally:
        _sink.reset(token)
