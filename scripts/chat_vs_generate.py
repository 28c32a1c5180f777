"""Chat app vs bare engine on the same prompt and settings, and the time from process start to a ready input.

    python scripts/chat_vs_generate.py [--pair smollm2-135m] [--k 4] [--repeats 3]

Runs the real `edgespec chat` app headless (Textual's run_test) with the real session factory, sends one prompt,
reads the decode tokens/s the app's status bar shows, and compares it with `Model.chat` of the same loaded
`edgespec.api.Model` driven directly (what `edgespec generate` runs), interleaved, median of repeats. A benchmark: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "Explain in a few sentences how a hash map works."


async def app_turn(factory, settings, first: bool, stream_interval: float | None = None, ui_nice: int = 10):
    """One app, one answer. The script waits on events the app's own handlers set, not by polling: a
    polling harness (Pilot.pause every few ms) would itself load the UI thread it is measuring."""
    from tui.app import ChatApp
    from tui.widgets import AssistantMessage

    class Observed(ChatApp):
        ready = asyncio.Event()
        done = asyncio.Event()

        # Textual also runs ChatApp's own handlers (it dispatches along the class hierarchy); these run
        # first, so the events are set once the app has handled the message.
        def on_model_ready(self, message) -> None:
            self.call_later(self.ready.set)

        def on_reply_done(self, message) -> None:
            self.call_later(self.done.set)

    kwargs = {"ui_nice": ui_nice} if stream_interval is None else {"stream_interval": stream_interval, "ui_nice": ui_nice}
    Observed.ready, Observed.done = asyncio.Event(), asyncio.Event()
    app = Observed(factory, settings=settings, **kwargs)
    async with app.run_test() as pilot:
        await asyncio.wait_for(app.ready.wait(), 600)
        ready_at = time.time()
        app.query_one("#prompt").insert(PROMPT)
        ui_cpu, wall = _ui_cpu(), time.perf_counter()
        if PROFILER is not None:
            PROFILER.enable()
        await pilot.press("enter")
        await asyncio.wait_for(app.done.wait(), 600)
        if PROFILER is not None:
            PROFILER.disable()
        ui_share = (_ui_cpu() - ui_cpu) / (time.perf_counter() - wall)
        await pilot.pause()
        text = app.query_one(AssistantMessage).text
        stats = app._stats  # what the status bar shows: the turn's TurnStats
    return ready_at, ui_share, text, stats


PROFILER = None


def _ui_cpu() -> float:
    """CPU seconds used so far by this (the UI) thread."""
    return time.thread_time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--k", default="4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", default=None, help="ONNX Runtime threads per model (default: all cores)")
    ap.add_argument("--stream-interval", type=float, default=None, help="seconds between UI updates (default: the app's)")
    ap.add_argument("--ui-nice", type=int, default=10, help="the UI thread's priority drop, as `edgespec chat` (10)")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the whole run (s)")
    ap.add_argument("--profile-ui", default=None, help="write cProfile stats of the UI thread while streaming here")
    args = ap.parse_args()
    global PROFILER
    if args.profile_ui:
        import cProfile

        PROFILER = cProfile.Profile()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    started = psutil.Process().create_time()
    os.environ.setdefault("EDGESPEC_DATA", "/tmp/edgespec-chat-bench")

    from edgespec.cli import build_parser, load_chat_model

    # The bare runs go to a thread started now, at normal priority: the app lowers this (main) thread's.
    bare = ThreadPoolExecutor(max_workers=1)
    bare.submit(lambda: None).result()
    extra = ["--threads", args.threads] if args.threads else []
    cli_args = build_parser().parse_args(["chat", "--pair", args.pair, "--k", args.k, "--target-device", "cpu", *extra])
    models = []

    def factory(progress):  # what `edgespec chat` loads, once: each app run gets the same model
        if not models:
            models.append(load_chat_model(cli_args, progress))
        return models[0]

    k = args.k if args.k == "auto" else int(args.k)
    settings = {"max_new_tokens": args.max_new_tokens, "k": k}
    app_tps, direct_tps, ui_shares, ready = [], [], [], None
    for rep in range(args.repeats):
        ready_at, ui_share, text, stats = asyncio.run(app_turn(factory, settings, rep == 0, args.stream_interval, args.ui_nice))
        ui_shares.append(ui_share)
        if ready is None:
            ready = ready_at - started
        app_tps.append(stats.decode_tokens_per_s)
        answer = bare.submit(lambda: models[0].chat([{"role": "user", "content": PROMPT}], max_tokens=args.max_new_tokens,
                                                    k=k)).result()
        direct_tps.append(answer.metrics.decode_tokens_per_s)
        assert answer.text == text, f"the app showed different text: {text!r} vs {answer.text!r}"
    a, d = statistics.median(app_tps), statistics.median(direct_tps)
    print(f"pair {args.pair}, K={args.k}, greedy, {args.max_new_tokens} new tokens max, {args.repeats} interleaved repeats")
    print(f"process start -> chat input ready (first app, warm cache): {ready:.2f} s")
    print(f"in the chat app : {a:.2f} tok/s (runs {', '.join(f'{x:.2f}' for x in app_tps)})")
    print(f"bare session    : {d:.2f} tok/s (runs {', '.join(f'{x:.2f}' for x in direct_tps)})")
    print(f"ratio app/bare  : {a / d:.3f}")
    paired = [x / y for x, y in zip(app_tps, direct_tps)]
    q1, _, q3 = statistics.quantiles(paired, n=4)
    print(f"paired ratios   : median {statistics.median(paired):.3f} (each app run over the bare run after it; "
          f"quartiles {q1:.3f}-{q3:.3f})")
    print(f"UI thread CPU while streaming: {100 * statistics.median(ui_shares):.1f}% of one core (median)")
    if PROFILER is not None:
        PROFILER.dump_stats(args.profile_ui)
        print(f"UI thread profile: {args.profile_ui} (python -m pstats)")
    print(f"load average    : {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
