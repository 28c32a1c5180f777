"""scripts/soak.py on tiny models, driving the chat as `edgespec chat` does (the app's factory, `Model.chat`
streamed): chats run to the context end, stop cleanly with their reason, and a new chat follows; the command line
writes soak.json/soak.md/soak.png and exits by its verdict, which fails on RSS growth and on threads left behind."""

import importlib.util
import json
import sys
import threading
from pathlib import Path

import pytest

from edgespec.errors import EdgespecError

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak_script"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("soak_script", None)


def tiny_options(tiny_checkpoints, *extra) -> list[str]:
    """`edgespec chat` options for the tiny pair on torch (no ONNX export: fast)."""
    return ["--target", str(tiny_checkpoints["target"]), "--draft", str(tiny_checkpoints["draft"]),
            "--target-backend", "torch", "--draft-backend", "torch", *extra]


def short_messages(soak) -> list[str]:
    """The bench prompts' user messages short enough for these contexts (one token a character here)."""
    messages = [m for m in soak.user_messages() if len(m) < 150]
    assert len(messages) >= 5
    return messages


def test_chats_run_to_the_context_end_and_a_new_chat_follows(soak, tiny_checkpoints):
    # Overlapped drafting: each request starts an edgespec-draft thread, which must be gone after it.
    model, settings, args = soak.chat_model(tiny_options(tiny_checkpoints, "--k", "3", "--overlap", "--threads", "1",
                                                         "--draft-threads", "1"), 48, lambda _line: None)
    assert model.description["overlap"] and model.description["drafter"] == "torch"
    # the app's settings: its defaults under the command line's, as Model.chat's keywords
    assert settings == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 48, "k": 3,
                        "speculation": True, "seed": None}
    messages = short_messages(soak)
    before = {t.ident for t in threading.enumerate()}
    result = soak.run_soak(model, settings, tokens=700, messages=messages, context=420, system=args.system)

    turns = result.turns
    assert result.context_limit == 420 and model.max_context == 420
    assert result.tokens >= 700 and result.tokens == sum(t.tokens for t in turns) == turns[-1].tokens_total
    ends = [i for i, t in enumerate(turns) if t.stop_reason in ("context", "error")]
    assert ends and ends[0] < len(turns) - 1, [t.stop_reason for t in turns]  # a chat ended, and the soak went on
    for i in ends:
        t = turns[i]
        if t.stop_reason == "context":  # the answer ran into the end: the context is exactly full
            assert t.context == 420 and t.tokens > 0 and t.error is None
        else:  # the next message no longer fits: Model.chat's one-line refusal, nothing generated
            assert not t.fits and t.tokens == 0 and "context holds 420" in t.error and "\n" not in t.error
            assert t.prefill_tokens is None
        new = turns[i + 1] if i + 1 < len(turns) else None
        if new is not None:  # the new chat starts from an empty history: only its first message is in the prompt
            assert (new.chat, new.turn) == (t.chat + 1, 1) and new.tokens > 0
            first = [{"role": "user", "content": messages[(i + 1) % len(messages)]}]  # one message a turn, in order
            assert new.prompt_tokens == len(model.encode_chat(first))
    assert result.chats >= 2 and max(t.chat for t in turns) == result.chats
    for prev, t in zip([None, *turns], turns):
        assert (t.context <= 420) == t.fits and t.rss_mb > 0 and t.os_threads >= t.py_threads >= 1
        assert t.notices == []  # the drafter never failed
        assert t.tokens < 2 or (t.drafted > 0 and 0 < t.k_mean <= 3)  # it drafted (fixed K = 3, less near the end)
        assert t.kv["draft_seen"] is not None and t.kv["target_capacity"] is None  # torch models: no ORT buffers
        if t.stop_reason != "error":
            assert 0 <= t.prefill_tokens < t.prompt_tokens
            if t.turn > 1:  # the last turn's prompt stayed in the target's cache: only the rest is prefilled
                assert t.prefill_tokens <= t.prompt_tokens - 1 - prev.prompt_tokens
        assert not any(n.startswith(soak.DRAFT_THREAD_PREFIX) for n in t.py_thread_names)
    assert {t.ident for t in threading.enumerate()} <= before | {threading.get_ident()}
    assert not model.busy  # every stream handed the device on

    summary = soak.summarise(result, warmup_tokens=50)
    assert summary["draft_threads_left"] == [] and summary["chats"] == result.chats
    assert summary["context_ends"] + summary["history_too_long_errors"] == len(ends)
    assert not [f for f in summary["failures"] if "thread" in f or "context" in f], summary["failures"]


def test_a_message_that_cannot_start_a_chat_is_an_error_not_an_endless_loop(soak, tiny_checkpoints):
    model, settings, _ = soak.chat_model(tiny_options(tiny_checkpoints, "--k", "2"), 8, lambda _line: None)
    with pytest.raises(EdgespecError, match="alone does not fit the context"):
        soak.run_soak(model, settings, tokens=100, messages=["x" * 200], context=100)


def test_the_command_line_writes_its_report_and_exits_by_the_verdict(soak, tiny_checkpoints, tmp_path, monkeypatch,
                                                                     capsys):
    short = short_messages(soak)
    monkeypatch.setattr(soak, "user_messages", lambda: short)
    out = tmp_path / "soak"
    argv = ["--tokens", "300", "--max-new-tokens", "48", "--context", "300", "--warmup-tokens", "50", "--out",
            str(out), *tiny_options(tiny_checkpoints, "--k", "3")]
    code = soak.main(argv)
    report = json.loads((out / "soak.json").read_text())
    meta, summary, turns = report["meta"], report["summary"], report["turns"]
    assert code == (0 if summary["ok"] else 1), summary["failures"]
    assert not [f for f in summary["failures"] if "thread" in f or "context" in f], summary["failures"]
    assert meta["settings"] == {"temperature": 0.0, "max_tokens": 48, "k": 3} and meta["drafter"] == "torch"
    assert summary["tokens"] >= 300 and summary["turns"] == len(turns) and summary["context_limit"] == 300
    reasons = [t["stop_reason"] for t in turns]
    assert set(reasons) <= {"eos", "length", "context", "error"}, reasons
    assert summary["context_ends"] + summary["history_too_long_errors"] >= 1 and summary["chats"] >= 2
    assert summary["stop_reasons"] == {r: reasons.count(r) for r in set(reasons)}
    assert [t["chat"] for t in turns] == sorted(t["chat"] for t in turns)
    md = (out / "soak.md").read_text()
    assert "Driven as `edgespec chat` drives it" in md and f"{summary['turns']} turns" in md
    assert (out / "soak.png").read_bytes().startswith(b"\x89PNG")
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-1].endswith("pass" if code == 0 else "; ".join(summary["failures"]))

    # bad options: one line, exit 2, before any model loads
    for bad, says in ((["--temperature", "-1"], "temperature"), (["--context", "1"], "--context 1 is too small"),
                      (["--tokens", "0"], "--tokens 0 must be at least 1")):
        assert soak.main([*bad, "--out", str(tmp_path / "bad")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("soak: error:") and says in lines[0], lines
    assert not (tmp_path / "bad").exists()


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
