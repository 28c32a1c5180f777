"""scripts/soak.py's loop on tiny models: chats run to the context end, stop cleanly with their reason, and a new
chat follows; its verdict fails on RSS growth and on threads left behind."""

import importlib.util
import sys
import threading
from pathlib import Path

import pytest

from edgespec.cli import build_parser
from edgespec.errors import EdgespecError
from edgespec.runtime import build_session
from edgespec.session import Settings

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_script"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("soak_script", None)


def tiny_session(tiny_checkpoints, *extra):
    args = build_parser().parse_args(["chat", "--target", str(tiny_checkpoints["target"]),
                                      "--draft", str(tiny_checkpoints["draft"]), "--target-backend", "torch",
                                      "--draft-backend", "torch", *extra])
    return build_session(args, progress=lambda _line: None)


def test_chats_run_to_the_context_end_and_a_new_chat_follows(soak, tiny_checkpoints):
    # Overlapped drafting: each request starts an edgespec-draft thread, which must be gone after it.
    session = tiny_session(tiny_checkpoints, "--k", "3", "--overlap", "--threads", "1", "--draft-threads", "1")
    assert session.engine.overlap
    settings = Settings(max_new_tokens=48, k=3)
    # the bench prompts' user messages short enough for this context (one token a character here)
    messages = [m for m in soak.user_messages() if len(m) < 150]
    assert len(messages) >= 5
    before = {t.ident for t in threading.enumerate()}
    result = soak.run_soak(session, settings, tokens=700, messages=messages, context=420)

    turns = result.turns
    assert result.context_limit == 420 and session.engine.target.max_context == 420
    assert result.tokens >= 700 and result.tokens == sum(t.tokens for t in turns) == turns[-1].tokens_total
    ends = [i for i, t in enumerate(turns) if t.stop_reason in ("context", "error")]
    assert ends and ends[0] < len(turns) - 1, [t.stop_reason for t in turns]  # a chat ended, and the soak went on
    for i in ends:
        t = turns[i]
        if t.stop_reason == "context":  # the answer ran into the end: the context is exactly full
            assert t.context == 420 and t.tokens > 0 and t.error is None
        else:  # the next message no longer fits: the engine's one-line refusal, nothing generated
            assert not t.fits and t.tokens == 0 and "context holds 420" in t.error and "\n" not in t.error
        new = turns[i + 1] if i + 1 < len(turns) else None
        if new is not None:  # the new chat starts from an empty history: only its first message is in the prompt
            assert (new.chat, new.turn) == (t.chat + 1, 1) and new.tokens > 0
            first = [{"role": "user", "content": messages[(i + 1) % len(messages)]}]  # one message a turn, in order
            assert new.prompt_tokens == len(session.encode(first))
    assert result.chats >= 2 and max(t.chat for t in turns) == result.chats
    for t in turns:
        assert (t.context <= 420) == t.fits and t.rss_mb > 0 and t.os_threads >= t.py_threads >= 1
        assert t.notices == []  # the drafter never failed
        assert t.tokens < 2 or (t.drafted > 0 and 0 < t.k_mean <= 3)  # it drafted (fixed K = 3, less near the end)
        assert t.kv["draft_seen"] is not None and t.kv["target_capacity"] is None  # torch models: no ORT buffers
        assert 0 <= t.prefill_tokens < t.prompt_tokens
        assert not any(n.startswith(soak.DRAFT_THREAD_PREFIX) for n in t.py_thread_names)
    assert {t.ident for t in threading.enumerate()} <= before | {threading.get_ident()}

    summary = soak.summarise(result, warmup_tokens=50)
    assert summary["draft_threads_left"] == [] and summary["chats"] == result.chats
    assert summary["context_ends"] + summary["history_too_long_errors"] == len(ends)
    assert not [f for f in summary["failures"] if "thread" in f or "context" in f], summary["failures"]


def test_a_message_that_cannot_start_a_chat_is_an_error_not_an_endless_loop(soak, tiny_checkpoints):
    session = tiny_session(tiny_checkpoints, "--k", "2")
    with pytest.raises(EdgespecError, match="alone does not fit the context"):
        soak.run_soak(session, Settings(max_new_tokens=8, k=2), tokens=100, messages=["x" * 200], context=100)


def turn(soak, chat, n, total, rss, *, reason="eos", names=("MainThread",)):
    return soak.TurnRecord(chat=chat, turn=n, tokens_total=total, tokens=100, prompt_tokens=50, context=150,
                           fits=True, stop_reason=reason, error=None, notices=[], rss_mb=rss,
                           py_threads=len(names), py_thread_names=list(names), os_threads=4, seconds=1.0,
                           k_mean=3.0, drafted=90, accepted=60, kv={}, prefill_tokens=10)


def synthetic(soak, rss_after, *, end_names=("MainThread",), end_os=4):
    turns = [turn(soak, 1, 1, 500, 100.0), turn(soak, 1, 2, 1000, 120.0, reason="context"),
             turn(soak, 2, 1, 1500, 121.0), turn(soak, 2, 2, 2000, rss_after)]
    return soak.SoakResult(turns=turns, chats=2, tokens=2000, start_rss_mb=90.0, start_py_threads=1,
                           start_os_threads=3, first_turn_py_threads=1, first_turn_os_threads=4,
                           end_py_threads=len(end_names), end_os_threads=end_os, end_thread_names=list(end_names),
                           context_limit=150)


def test_the_verdict_measures_from_the_first_context_end_and_fails_on_growth_or_threads(soak):
    # RSS rises while the first chat fills the context (the KV buffers), then must stay within 5% of it.
    ok = soak.summarise(synthetic(soak, 125.0), warmup_tokens=100)
    assert ok["ok"], ok["failures"]
    assert ok["warmup_turn"] == 2 and ok["rss_warm_mb"] == 120.0
    assert ok["rss_growth_pct"] == pytest.approx(4.17, abs=0.01)
    grown = soak.summarise(synthetic(soak, 127.0), warmup_tokens=100)
    assert not grown["ok"] and "RSS grew 5.8%" in grown["failures"][0]
    # a later --warmup-tokens moves the reference: growth is then measured from turn 3
    assert soak.summarise(synthetic(soak, 125.0), warmup_tokens=1500)["warmup_turn"] == 3
    left = soak.summarise(synthetic(soak, 120.0, end_names=("MainThread", "edgespec-draft_0")), warmup_tokens=100)
    assert left["draft_threads_left"] == ["edgespec-draft_0"]
    assert any("drafter thread(s) left behind" in f for f in left["failures"])
    assert any("1 Python thread(s) more" in f for f in left["failures"])
    more_os = soak.summarise(synthetic(soak, 120.0, end_os=6), warmup_tokens=100)
    assert more_os["failures"] == ["2 OS thread(s) more at the end than after the first turn"]
    none_after = soak.summarise(synthetic(soak, 120.0), warmup_tokens=5000)
    assert not none_after["ok"] and "no turn after the warm-up" in none_after["failures"][0]
