"""Chat app vs bare engine on the same prompt and settings, and the time from process start to a ready input.

    python scripts/chat_vs_generate.py [--pair smollm2-135m] [--k 4] [--repeats 3]

Runs the real `edgespec chat` app headless (Textual's run_test) with the real session factory, sends one prompt,
reads the decode tokens/s the app's status bar shows, and compares it with `ChatSession.reply` driven directly
(what `edgespec generate` runs), interleaved, median of repeats. A benchmark: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "tui"))

PROMPT = "Explain in a few sentences how a hash map works."


async def app_turn(factory, settings, first: bool, stream_interval: float | None = None):
    from fakes import wait_until

    from tui.app import ChatApp
    from tui.widgets import AssistantMessage

    kwargs = {} if stream_interval is None else {"stream_interval": stream_interval}
    app = ChatApp(factory, settings=settings, **kwargs)
    ready_at = None
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.session is not None, timeout=600)
        ready_at = time.time()
        app.query_one("#prompt").insert(PROMPT)
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.query(AssistantMessage) and not app.generating, timeout=600)
        stats = app._last_stats if hasattr(app, "_last_stats") else None
        text = app.query_one(AssistantMessage).text
    return ready_at, stats, text, app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--k", default="4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", default=None, help="ONNX Runtime threads per model (default: all cores)")
    ap.add_argument("--stream-interval", type=float, default=None, help="seconds between UI updates (default: the app's)")
    args = ap.parse_args()
    started = psutil.Process().create_time()
    os.environ.setdefault("EDGESPEC_DATA", "/tmp/edgespec-chat-bench")

    from edgespec.cli import build_parser
    from edgespec.runtime import build_session
    from edgespec.session import Settings

    extra = ["--threads", args.threads] if args.threads else []
    cli_args = build_parser().parse_args(["chat", "--pair", args.pair, "--k", args.k, "--target-device", "cpu", *extra])
    sessions = []

    def factory(progress):
        if not sessions:
            sessions.append(build_session(cli_args, progress=progress))
        return sessions[0]

    k = args.k if args.k == "auto" else int(args.k)
    settings = {"max_new_tokens": args.max_new_tokens, "k": k}
    app_tps, direct_tps, ready = [], [], None
    for rep in range(args.repeats):
        ready_at, _, text, app = asyncio.run(app_turn(factory, settings, rep == 0, args.stream_interval))
        if ready is None:
            ready = ready_at - started
        m = sessions[0].last_metrics
        app_tps.append(m.decode_tokens_per_s)
        chunks = list(sessions[0].reply([{"role": "user", "content": PROMPT}], Settings(max_new_tokens=args.max_new_tokens, k=k)))
        direct_tps.append(chunks[-1].metrics.decode_tokens_per_s)
        assert "".join(c.text for c in chunks) == text, "the app showed different text"
    a, d = statistics.median(app_tps), statistics.median(direct_tps)
    print(f"pair {args.pair}, K={args.k}, greedy, {args.max_new_tokens} new tokens max, {args.repeats} interleaved repeats")
    print(f"process start -> chat input ready (first app, warm cache): {ready:.2f} s")
    print(f"in the chat app : {a:.2f} tok/s (runs {', '.join(f'{x:.2f}' for x in app_tps)})")
    print(f"bare session    : {d:.2f} tok/s (runs {', '.join(f'{x:.2f}' for x in direct_tps)})")
    print(f"ratio app/bare  : {a / d:.3f}")
    print(f"load average    : {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
