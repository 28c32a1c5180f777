"""The pure parts of the widgets and the settings dialog: runs, blocks, the status line, validation."""

from __future__ import annotations

import pytest
from fakes import GatedModel, fixed_factory, wait_until
from rich.text import Text

from tui.app import ChatApp
from tui.settings import parse_settings
from tui.widgets import (
    AssistantMessage,
    TurnStats,
    cut_block,
    format_status,
    merge_runs,
)

VALID = {"temperature": "0.7", "top_p": "0.95", "max_new_tokens": "256", "k": "auto"}


def test_merge_runs_joins_neighbours_of_one_origin():
    runs: list = []
    merge_runs(runs, [("a", "draft"), ("b", "draft"), ("", "target"), ("c", "target")])
    merge_runs(runs, [("d", "target"), ("e", "draft")])
    assert runs == [["ab", "draft"], ["cd", "target"], ["e", "draft"]]


def test_cut_block_cuts_long_tails_at_the_last_newline():
    assert cut_block(Text("short\ntext"), limit=400) is None
    assert cut_block(Text("x" * 500), limit=400) is None  # no newline: cannot cut without breaking a line
    text = Text("a" * 300 + "\n\n" + "b" * 150)
    text.stylize("red", 0, 10)
    head, tail = cut_block(text, limit=400)
    assert head.plain == "a" * 300 + "\n" and tail.plain == "b" * 150
    assert head.spans and head.spans[0].style == "red"


def stats(**kw) -> TurnStats:
    base = {"k": 4, "speculation": True, "tokens": 10, "tokens_per_s": 9.0, "decode_tokens_per_s": 30.0,
            "acceptance_rate": 0.5, "tau": 2.0, "num_draft_tokens": 8}
    return TurnStats(**{**base, **kw})


def test_status_shows_the_speedup_only_with_a_plain_baseline_and_speculation_on():
    common = {"target": "T", "draft": "D", "speculation": True, "k_setting": 4, "colour": True}
    assert "speedup —" in format_status(stats=stats(), plain_tps=None, **common).plain
    line = format_status(stats=stats(), plain_tps=12.0, **common).plain
    assert "speedup ×2.50 vs plain" in line and "30.0 tok/s" in line and "acceptance 0.50" in line
    assert "τ 2.00" in line and "K 4" in line
    plain = format_status(stats=stats(speculation=False, k=0, num_draft_tokens=0), plain_tps=12.0, **common).plain
    assert "speedup —" in plain and "acceptance —" in plain
    assert "K 4 (auto)" in format_status(stats=stats(), plain_tps=None, **{**common, "k_setting": "auto"}).plain


def test_parse_settings_accepts_valid_values():
    assert parse_settings(VALID) == {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 256, "k": "auto"}
    assert parse_settings({**VALID, "k": " 0 "})["k"] == 0
    assert parse_settings({**VALID, "k": "AUTO"})["k"] == "auto"


@pytest.mark.parametrize("name,value", [("temperature", "nan"), ("temperature", "inf"), ("top_p", "1.5"),
                                        ("max_new_tokens", "0"), ("max_new_tokens", "x"), ("k", "-1"), ("k", "")])
def test_parse_settings_rejects_invalid_values(name, value):
    with pytest.raises(ValueError):
        parse_settings({**VALID, name: value})


@pytest.mark.asyncio
async def test_a_long_coloured_answer_is_drawn_in_blocks_that_keep_the_text():
    paragraph = "word " * 30 + "\n\n"
    script = [[(paragraph, "draft" if i % 2 else "target")] for i in range(12)]
    model = GatedModel(script, gated=False)
    app = ChatApp(fixed_factory(model), stream_interval=0)
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.model is not None)
        app.query_one("#prompt").insert("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.query(AssistantMessage) and not app.generating)
        view = app.query_one(AssistantMessage)
        blocks = [b.content.plain for b in view.query(".block")]
        assert len(blocks) > 1
        assert "\n".join(blocks) == view.text == paragraph * 12
        await pilot.press("f2", "f2")  # markdown and back: rebuilt from the runs
        await wait_until(pilot, lambda: view.query_one(".coloured").display)
        assert "\n".join(b.content.plain for b in view.query(".block")) == paragraph * 12


@pytest.mark.asyncio
async def test_a_streaming_tail_keeps_spare_lines_and_never_clips_then_fits_its_text():
    """While streaming, the tail has a fixed height a few lines above its text (a new line then only repaints
    it, no layout of the whole screen); every line stays visible; at the end the spare lines go."""
    from tui.widgets import RESERVE_LINES

    words = [[("lorem ipsum dolor sit amet ", "draft" if i % 3 else "target")] for i in range(40)]
    model = GatedModel(words)
    app = ChatApp(fixed_factory(model), stream_interval=0)
    async with app.run_test(size=(60, 40)) as pilot:
        await wait_until(pilot, lambda: app.model is not None)
        app.query_one("#prompt").insert("hi")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.query(AssistantMessage))
        view = app.query_one(AssistantMessage)
        heights = set()
        for i in range(len(words) - 1):
            model.release()
            await wait_until(pilot, lambda i=i: len(view.text) == len(words[0][0][0]) * (i + 1))
            await pilot.pause()
            tail = view._tail_view
            lines = view._wrapped_lines(view._tail)
            assert lines <= tail.region.height <= lines + RESERVE_LINES + 1, (lines, tail.region.height)
            heights.add(tail.region.height)
        assert 1 < len(heights) < 40 // RESERVE_LINES  # grew in steps, not line by line
        model.release()
        await wait_until(pilot, lambda: not app.generating)
        await pilot.pause()
        tail = view._tail_view
        assert tail.region.height == view._wrapped_lines(view._tail)
