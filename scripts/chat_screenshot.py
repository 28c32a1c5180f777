"""Save an SVG screenshot of `edgespec chat` with scripted content (no model runs) to docs/chat.svg.

The conversation and every number in the status bar (the plain-decoding baseline of the first turn
included) come from `tui.demo`, so the picture is the same on every machine; it illustrates the UI, it
measures nothing.
Usage: python scripts/chat_screenshot.py [OUT.svg] [--size 100x30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


async def shoot(out: Path, size: tuple[int, int]) -> None:
    from tui.app import ChatApp
    from tui.demo import demo_factory, play_demo

    app = ChatApp(demo_factory, system="You are a concise assistant.")
    async with app.run_test(size=size) as pilot:
        await play_demo(pilot)
        out.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(ROOT / "docs" / "chat.svg"))
    parser.add_argument("--size", default="100x26", help="terminal WIDTHxHEIGHT")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["EDGESPEC_DATA"] = tmp  # never touch the user's chats
        asyncio.run(shoot(Path(args.out), (width, height)))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
