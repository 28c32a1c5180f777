"""The main screen after the scripted demo (a plain turn, then a speculative one), compared with the SVG
accepted in __snapshots__/. After an intended UI change: `pytest tests/tui/test_snapshot.py --snapshot-update`,
then look at the new SVG before committing it.
"""

from __future__ import annotations

from tui.app import ChatApp
from tui.demo import demo_factory, play_demo


def test_main_screen(snap_compare):
    app = ChatApp(demo_factory, system="You are a concise assistant.")
    assert snap_compare(app, terminal_size=(100, 26), run_before=play_demo)
