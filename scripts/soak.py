"""Soak: a long chat on the real default pair, driven as `edgespec chat` drives it, watching memory and threads.

    python scripts/soak.py [--tokens 10000] [--max-new-tokens 1024] [--context N] [--warmup-tokens 1000]
                           [--out docs/soak] [any other `edgespec chat` option: --pair, --target, --draft, --k,
                           --overlap, --system, ...]

It drives the chat as the chat app (tui/app.py) does, through the Python API. The model comes from the app's
factory, `cli.load_chat_model`, given `edgespec chat`'s own command line (its parser and `check_args`, so the same
options and defaults: K = auto with this machine's profile and its drafter, overlap as the runtime decides). Each
turn streams `Model.chat(messages, system=, stream=True, cancel=, **settings)` with the settings the app sends
(`tui.app.request_settings` of `DEFAULT_SETTINGS` under the command line's, validated by the settings dialog's
`parse_settings`, as `edgespec chat` makes them), reading chunks until one carries a stop reason, as the app's
model thread does. The history is the app's: a `tui.history.ChatRecord` whose `model_messages()` each turn sends,
each answer's text joined from its pieces. The user messages are the last user message of each prompt of
edgespec/data/bench_prompts.jsonl, in turn, so every chat grows until its context ends, which the script sees as
the app sees it: the stream's stop reason "context" (the answer reached the end of the context), or the one-line
EdgespecError (`RequestError`) `Model.chat` raises when the history no longer fits. It then starts a new chat, a
fresh `ChatRecord` as the app's Ctrl+N does, and goes on until `--tokens` tokens were generated in all. (The app
runs the turns on its one model thread behind a Textual screen; here they run on the main thread with no screen:
the soak watches the model and the API, not the UI.)

After every turn it records, from the stream's `Completion` (its token ids, prompt and cached tokens, metrics and
notices): the tokens so far, the process's RSS (psutil), the live Python threads (threading.enumerate) and the
process's OS threads (psutil), the stop reason and any notice. At the end it writes soak.json, soak.md and
soak.png (RSS against tokens) to --out, and exits 1 if RSS grew more than 5% after the warm-up or a thread was
left behind (an edgespec-draft thread alive, or more threads than at the start); 2 for a bad option.

The warm-up: the KV buffers grow with the context and are kept between requests (they never shrink), so RSS
legitimately rises until the first chat has filled the context once. The reference point is therefore the end
of the first chat (its context end), or the first `--warmup-tokens` tokens if that comes later.

`--context N` caps the context requests may use (`Model.limit_context`) below the model's own, to reach more
context ends in fewer tokens; the default is the model's full context, as `edgespec chat` uses it.
Not a speed measurement: the tokens/s it prints depend on what else runs on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgespec.errors import EdgespecError  # noqa: E402
from tui.history import ChatRecord  # noqa: E402

DRAFT_THREAD_PREFIX = "edgespec-draft"  # edgespec.scheduler.THREAD_PREFIX
RSS_LIMIT_PCT = 5.0


@dataclass
class TurnRecord:
    chat: int
    turn: int  # within the chat, from 1
    tokens_total: int  # generated in the whole soak so far, this turn included
    tokens: int  # generated in this turn
    prompt_tokens: int  # the history as the model sees it (the chat template applied: `Model.encode_chat`)
    context: int  # prompt + generated: where the chat's context stands after this turn
    fits: bool  # the prompt fits the context (else `Model.chat` must refuse it with its one-line error)
    stop_reason: str  # eos / length / context / stop / cancelled, or "error" (then `error` says why)
    error: str | None
    notices: list[str]
    rss_mb: float
    py_threads: int
    py_thread_names: list[str]
    os_threads: int  # right after the turn (a drafter thread may still be exiting: see `settled_os_threads`)
    seconds: float
    k_mean: float  # mean K over the turn's rounds (0: the target alone)
    drafted: int  # draft tokens proposed in this turn
    accepted: int
    # Positions the models' KV buffers hold, and the tokens the draft model has taken in (diagnostics: the
    # buffers grow, never shrink, so RSS rises whenever one of them reaches a length it never had before).
    kv: dict
    prefill_tokens: int | None  # what the target had to take in (the prompt less the prefix its cache kept,
    # `Completion.cached_tokens`); None when the turn ran nothing


@dataclass
class SoakResult:
    turns: list[TurnRecord] = field(default_factory=list)
    chats: int = 0
    tokens: int = 0
    seconds: float = 0.0
    start_rss_mb: float = 0.0
    start_py_threads: int = 0
    start_os_threads: int = 0
    first_turn_py_threads: int = 0
    first_turn_os_threads: int = 0
    end_py_threads: int = 0
    end_os_threads: int = 0
    end_thread_names: list[str] = field(default_factory=list)
    context_limit: int = 0


def user_messages(path: Path | None = None) -> list[str]:
    """Varied user messages: the last user message of each bench prompt, in file order."""
    path = path or Path(__file__).resolve().parent.parent / "edgespec" / "data" / "bench_prompts.jsonl"
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            messages = json.loads(line)["messages"]
            out.append([m["content"] for m in messages if m["role"] == "user"][-1])
    return out


def rss_mb(proc: psutil.Process) -> float:
    return proc.memory_info().rss / 2**20


def kv_state(model) -> dict:
    """Positions the target's and the draft model's KV buffers hold (ONNX Runtime models: `OnnxLM`'s private
    `_capacity`; None elsewhere) and the tokens the draft model's cache has taken in. A diagnostic read of the
    loaded runtime's buffers (what RSS follows), not part of how the soak drives the chat."""
    engine = model.runtime.engine
    target_lm = getattr(engine.target, "lm", None)
    draft_lm = getattr(engine.drafter, "lm", None)
    cache = getattr(engine.drafter, "_cache", None)
    return {"target_capacity": getattr(target_lm, "_capacity", None),
            "draft_capacity": getattr(draft_lm, "_capacity", None),
            "draft_seen": len(cache.ids) if cache is not None else None}


def settled_os_threads(proc: psutil.Process, *, steady_s: float = 0.2, cap_s: float = 10.0) -> int:
    """The process's OS threads once the count has held still for `steady_s` (at most `cap_s`): a joined
    Python thread (the drafter's, after each overlapped request) releases its join before its OS thread has
    quite gone, so a count taken right after a request can be one or two high."""
    start = time.monotonic()
    count, since = proc.num_threads(), time.monotonic()
    while time.monotonic() - since < steady_s and time.monotonic() - start < cap_s:
        time.sleep(0.01)
        now = proc.num_threads()
        if now != count:
            count, since = now, time.monotonic()
    return count


def chat_model(options: list[str], max_new_tokens: int, progress):
    """`edgespec chat`'s model and its turns' settings, made from its command line `options` as the CLI and the
    app make them: the chat's parser and `check_args` (cli.main), the settings dialog's validation over
    `DEFAULT_SETTINGS` (cli.cmd_chat, `ChatApp`), `request_settings` (each turn's `Model.chat` keywords) and the
    app's factory `load_chat_model`. Returns (model, settings, parsed arguments)."""
    from edgespec.cli import build_parser, chat_settings, check_args, load_chat_model
    from tui.app import DEFAULT_SETTINGS, request_settings

    args = build_parser().parse_args(["chat", "--max-new-tokens", str(max_new_tokens), *options])
    check_args(args)
    settings = request_settings({**DEFAULT_SETTINGS, **chat_settings(args)})
    return load_chat_model(args, progress), settings, args


def run_soak(model, settings: dict, *, tokens: int, messages: list[str], context: int | None = None,
             system: str | None = None, log=None) -> SoakResult:
    """Chat with `model` (an `edgespec.api.Model`) as the chat app does, each turn streaming
    `Model.chat(history, system=, stream=True, cancel=, **settings)` (`settings`: `request_settings`' keywords),
    until `tokens` tokens were generated: each chat runs until its context ends (a "context" stop, or the
    EdgespecError of a history that no longer fits), then a new one starts. `context` caps the model's context
    (`Model.limit_context`). Any other exception is a bug and propagates."""
    if context is not None:
        model.limit_context(context)
    proc = psutil.Process()
    result = SoakResult(start_rss_mb=rss_mb(proc), start_py_threads=threading.active_count(),
                        start_os_threads=settled_os_threads(proc), context_limit=model.max_context)
    start = time.perf_counter()
    conversation = ChatRecord.new(system)  # kept in memory only: the soak saves no chat
    chat, turn, next_message = 1, 0, 0
    while result.tokens < tokens:
        turn += 1
        conversation.messages.append({"role": "user", "content": messages[next_message % len(messages)]})
        next_message += 1
        history = conversation.model_messages()  # what the app sends: role and content only
        prompt_tokens = len(model.encode_chat(history, system))  # counted here too: a refused prompt has no stream
        t0 = time.perf_counter()
        answer, pieces, reason, error = None, [], None, None
        try:
            answer = model.chat(history, system=system, stream=True, cancel=threading.Event(), **settings)
            with contextlib.closing(answer):  # as the app: the device is handed on however the loop ends
                for chunk in answer:
                    pieces.extend(chunk.pieces)
                    reason = chunk.stop_reason
                    if reason is not None:
                        break
        except EdgespecError as err:  # the history no longer fits the prompt: the chat's end, said in one line
            if turn == 1 and prompt_tokens >= model.max_context:  # a new chat that cannot start would loop for ever
                raise EdgespecError(f"a user message alone does not fit the context ({err}); raise --context") from None
            reason, error = "error", str(err)
        entry = {"role": "assistant", "content": "".join(text for text, _ in pieces)}
        conversation.messages.append({**entry, "error": error} if error else entry)  # as the app keeps a failed turn
        if answer is None:  # refused before it ran
            n, notices, ks, drafted, accepted, prefill = 0, [], [], 0, 0, None
        else:
            done = answer.result()
            m = done.metrics
            n, notices, ks = len(done.token_ids), list(done.notices), m.k_per_round
            drafted, accepted = m.num_draft_tokens, m.num_accepted_tokens
            prefill = done.prompt_tokens - 1 - done.cached_tokens  # the last one goes in with the first verification
        result.tokens += n
        names = sorted(t.name for t in threading.enumerate())
        record = TurnRecord(chat=chat, turn=turn, tokens_total=result.tokens, tokens=n, prompt_tokens=prompt_tokens,
                            context=prompt_tokens + n, fits=prompt_tokens < model.max_context,
                            stop_reason=reason or "none", error=error, notices=notices,
                            rss_mb=round(rss_mb(proc), 2), py_threads=len(names), py_thread_names=names,
                            os_threads=proc.num_threads(), seconds=round(time.perf_counter() - t0, 3),
                            k_mean=round(sum(ks) / len(ks), 2) if ks else 0.0, drafted=drafted, accepted=accepted,
                            kv=kv_state(model), prefill_tokens=prefill)
        result.turns.append(record)
        if len(result.turns) == 1:  # thread pools a first request starts lazily (torch's, ORT's) are no leak
            result.first_turn_py_threads, result.first_turn_os_threads = record.py_threads, settled_os_threads(proc)
        if log is not None:
            log(record)
        if reason in ("context", "error"):  # the app offers a new chat here (Ctrl+N): take it
            conversation, chat, turn = ChatRecord.new(system), chat + 1, 0
    result.chats = chat if conversation.messages else chat - 1
    result.seconds = round(time.perf_counter() - start, 1)
    names = sorted(t.name for t in threading.enumerate())
    result.end_py_threads, result.end_os_threads, result.end_thread_names = len(names), settled_os_threads(proc), names
    return result


def summarise(result: SoakResult, *, warmup_tokens: int = 1000) -> dict:
    """The verdict: RSS after the warm-up against the rest, and the threads at the start against the end."""
    turns = result.turns
    first_end = next((i for i, t in enumerate(turns) if t.stop_reason in ("context", "error")), None)
    by_tokens = next((i for i, t in enumerate(turns) if t.tokens_total >= warmup_tokens), None)
    warm = None if by_tokens is None else max(by_tokens, first_end if first_end is not None else len(turns) - 1)
    out: dict = {"tokens": result.tokens, "turns": len(turns), "chats": result.chats, "seconds": result.seconds,
                 "context_limit": result.context_limit,
                 "context_ends": sum(t.stop_reason == "context" for t in turns),
                 "history_too_long_errors": sum(t.stop_reason == "error" for t in turns),
                 "stop_reasons": {r: sum(t.stop_reason == r for t in turns) for r in sorted({t.stop_reason for t in turns})},
                 "notices": sorted({n for t in turns for n in t.notices}),
                 "rss_start_mb": round(result.start_rss_mb, 1), "rss_max_mb": max((t.rss_mb for t in turns), default=0),
                 "rss_end_mb": turns[-1].rss_mb if turns else 0.0}
    failures = []
    if warm is None or warm == len(turns) - 1:
        out.update(warmup_turn=None, rss_warm_mb=None, rss_growth_pct=None, rss_max_deviation_pct=None)
        failures.append("no turn after the warm-up: give more --tokens (or a smaller --context)")
    else:
        base = turns[warm].rss_mb
        after = [t.rss_mb for t in turns[warm + 1:]]
        growth = (after[-1] - base) / base * 100
        deviation = max(abs(r - base) for r in after) / base * 100
        out.update(warmup_turn=warm + 1, warmup_tokens=turns[warm].tokens_total, rss_warm_mb=base,
                   rss_growth_pct=round(growth, 2), rss_max_deviation_pct=round(deviation, 2),
                   rss_max_after_warmup_mb=max(after))
        if max(after) > base * (1 + RSS_LIMIT_PCT / 100):
            failures.append(f"RSS grew {(max(after) - base) / base * 100:.1f}% after the warm-up "
                            f"({base:.0f} MB -> {max(after):.0f} MB), over the {RSS_LIMIT_PCT:.0f}% limit")
    for t in turns:
        if t.stop_reason == "error" and (t.fits or "\n" in (t.error or "")):
            failures.append(f"chat {t.chat} turn {t.turn} failed with a prompt that fits the context, or not in "
                            f"one line: {t.error}")
        if t.stop_reason == "context" and t.context < result.context_limit:
            failures.append(f"chat {t.chat} turn {t.turn} stopped for the context at {t.context} tokens of "
                            f"{result.context_limit}")
    left = [n for n in result.end_thread_names if n.startswith(DRAFT_THREAD_PREFIX)]
    out.update(py_threads_start=result.start_py_threads, py_threads_end=result.end_py_threads,
               py_threads_after_first_turn=result.first_turn_py_threads,
               os_threads_after_first_turn=result.first_turn_os_threads,
               os_threads_start=result.start_os_threads, os_threads_end=result.end_os_threads,
               os_threads_max=max((t.os_threads for t in turns), default=0),
               draft_threads_left=left, thread_names_end=result.end_thread_names)
    if left:
        failures.append(f"drafter thread(s) left behind: {', '.join(left)}")
    if result.end_py_threads > result.start_py_threads:
        failures.append(f"{result.end_py_threads - result.start_py_threads} Python thread(s) more at the end than at the start")
    # Against the first turn: the thread pools torch and ONNX Runtime start at their first parallel op stay.
    if result.end_os_threads > result.first_turn_os_threads:
        failures.append(f"{result.end_os_threads - result.first_turn_os_threads} OS thread(s) more at the end "
                        f"than after the first turn")
    out["failures"] = failures
    out["ok"] = not failures
    return out


def write_report(out_dir: Path, result: SoakResult, summary: dict, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                   "turns": [asdict(t) for t in result.turns]}, indent=1) + "\n")
    s = summary
    lines = [
        "# Soak: a long chat on the default pair",
        "",
        f"`{meta['command']}` ({meta['date']}), {meta['target']} · draft: {meta['draft']} · drafter "
        f"{meta['drafter']} · overlap {meta['overlap']}; settings: {meta['settings']}; context limit "
        f"{s['context_limit']} tokens.",
        f"Driven as `edgespec chat` drives it: {meta['drives']}.",
        f"Machine: {meta['machine']}; load average {meta['load_start']} at the start, {meta['load_end']} at the end "
        "(the cores are shared with other work: not a speed measurement).",
        "",
        f"- **{s['tokens']} tokens** generated in **{s['turns']} turns** over **{s['chats']} chats** "
        f"in {s['seconds']:.0f} s ({s['tokens'] / max(s['seconds'], 1e-9):.1f} tokens/s).",
        f"- Chat ends: {s['context_ends']} at the context end (stop reason `context`), {s['history_too_long_errors']} "
        "by the one-line error of a history that no longer fits the prompt; a new chat followed each. "
        f"Stop reasons of all turns: {s['stop_reasons']}. Notices: {s['notices'] or 'none'}.",
    ]
    if s["rss_warm_mb"] is not None:
        lines.append(f"- **RSS**: {s['rss_start_mb']} MB at the start (models loaded), {s['rss_warm_mb']} MB after the "
                     f"warm-up (turn {s['warmup_turn']}, {s['warmup_tokens']} tokens: the first chat filled the context "
                     f"once), {s['rss_end_mb']} MB at the end: {s['rss_growth_pct']:+.2f}% end vs warm-up, largest "
                     f"deviation after the warm-up {s['rss_max_deviation_pct']:.2f}% (limit {RSS_LIMIT_PCT:.0f}%).")
    lines += [
        f"- **Threads**: Python {s['py_threads_start']} at the start (models loaded), {s['py_threads_end']} at the "
        f"end; OS threads {s['os_threads_start']} at the start, {s['os_threads_after_first_turn']} after the first "
        f"turn, {s['os_threads_end']} at the end (at most {s['os_threads_max']} after any turn); edgespec-draft "
        f"threads left: {len(s['draft_threads_left'])}.",
        f"- Verdict: **{'pass' if s['ok'] else 'FAIL'}**" + ("" if s["ok"] else ": " + "; ".join(s["failures"])),
        "",
        "![RSS against tokens](soak.png)",
        "",
        "| chat | turns | tokens | ended by | context at the end | RSS at the end (MB) |",
        "|---:|---:|---:|---|---:|---:|",
    ]
    for chat in sorted({t.chat for t in result.turns}):
        ts = [t for t in result.turns if t.chat == chat]
        last = ts[-1]
        ctx = max(t.context for t in ts)
        lines.append(f"| {chat} | {len(ts)} | {sum(t.tokens for t in ts)} | {last.stop_reason} | {ctx} | {last.rss_mb} |")
    (out_dir / "soak.md").write_text("\n".join(lines) + "\n")
    plot(out_dir / "soak.png", result, summary)


def plot(path: Path, result: SoakResult, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    xs = [0] + [t.tokens_total for t in result.turns]
    ax.plot(xs, [result.start_rss_mb] + [t.rss_mb for t in result.turns], marker=".", label="RSS after each turn")
    for t in result.turns:
        if t.stop_reason in ("context", "error"):
            ax.axvline(t.tokens_total, color="grey", linestyle=":", linewidth=1)
    if summary.get("rss_warm_mb"):
        base = summary["rss_warm_mb"]
        ax.axhspan(base, base * (1 + RSS_LIMIT_PCT / 100), color="green", alpha=0.1, label=f"warm-up RSS +{RSS_LIMIT_PCT:.0f}%")
        ax.axvline(summary["warmup_tokens"], color="green", linewidth=1, label="end of warm-up")
    ax.set_xlabel("tokens generated (dotted: a chat ended, a new one started)")
    ax.set_ylabel("RSS (MB)")
    ax.set_title("edgespec chat soak: RSS against tokens")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other options go to `edgespec chat`'s parser (model, --k, --overlap, ...).")
    p.add_argument("--tokens", type=int, default=10_000, help="tokens to generate in all (default 10000)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="per answer (default 1024: long answers)")
    p.add_argument("--context", type=int, default=None, help="cap the context below the model's (default: the model's)")
    p.add_argument("--warmup-tokens", type=int, default=1000,
                   help="the warm-up lasts at least this many tokens, and at least until the first chat ended")
    p.add_argument("--out", default="docs/soak", help="folder for soak.json, soak.md, soak.png")
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    from edgespec.hardware import describe

    argv = sys.argv[1:] if argv is None else argv
    ours, rest = parse_args(argv)
    try:
        if ours.tokens < 1:
            raise EdgespecError(f"--tokens {ours.tokens} must be at least 1")
        if ours.context is not None and ours.context < 2:
            raise EdgespecError(f"--context {ours.context} is too small; give at least 2 tokens")
        load_start = [round(x, 2) for x in os.getloadavg()]
        t0 = time.perf_counter()
        model, settings, chat_args = chat_model(rest, ours.max_new_tokens,
                                                lambda line: print(f"  {line}", file=sys.stderr, flush=True))
        d = model.description
        print(f"ready in {time.perf_counter() - t0:.0f} s: {d['target']} · draft: {d['draft']} · drafter "
              f"{d['drafter']} · overlap {d['overlap']}", file=sys.stderr, flush=True)

        def log(t: TurnRecord):
            print(f"chat {t.chat} turn {t.turn}: {t.tokens} tokens ({t.tokens_total} in all), context {t.context}, "
                  f"{t.stop_reason}{' (' + t.error + ')' if t.error else ''}, RSS {t.rss_mb:.0f} MB, "
                  f"threads {t.py_threads}/{t.os_threads}, {t.seconds:.0f} s, prefill {t.prefill_tokens}, K {t.k_mean}, "
                  f"kv {t.kv}", file=sys.stderr, flush=True)

        result = run_soak(model, settings, tokens=ours.tokens, messages=user_messages(), context=ours.context,
                          system=chat_args.system, log=log)
    except (EdgespecError, ValueError) as err:
        print(f"soak: error: {err}", file=sys.stderr)
        return 2
    summary = summarise(result, warmup_tokens=ours.warmup_tokens)
    machine = describe()
    meta = {"command": "python scripts/soak.py " + " ".join(argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "drives": "`cli.load_chat_model`, then `Model.chat(history, system=, stream=True, cancel=, **settings)` "
                      "each turn",
            "target": d["target"], "draft": d["draft"] or "none", "drafter": d["drafter"], "overlap": d["overlap"],
            "settings": {k: settings[k] for k in ("temperature", "max_tokens", "k")},
            "machine": f"{machine.cpu_model}, {machine.cores_usable} usable cores",
            "load_start": load_start, "load_end": [round(x, 2) for x in os.getloadavg()]}
    write_report(Path(ours.out), result, summary, meta)
    print(f"{summary['tokens']} tokens, {summary['turns']} turns, {summary['chats']} chats; RSS warm "
          f"{summary['rss_warm_mb']} MB -> end {summary['rss_end_mb']} MB ({summary['rss_growth_pct']}%, max deviation "
          f"{summary['rss_max_deviation_pct']}%); threads {summary['os_threads_start']} -> {summary['os_threads_end']}: "
          f"{'pass' if summary['ok'] else 'FAIL: ' + '; '.join(summary['failures'])}", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
