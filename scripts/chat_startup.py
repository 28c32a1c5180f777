"""Time from starting `edgespec chat` to a ready chat (the model loaded, the status bar naming it), in a real
terminal: the app runs in a pseudo-terminal exactly as a user starts it, and the clock stops when the status
bar's model line (`<model> · <backend> <device> <precision>`) first appears on the screen.

    python scripts/chat_startup.py [--repeats 5] [-- extra chat arguments]

A benchmark: run it on a quiet machine with a warm cache (run `edgespec prepare` or one chat first).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import select
import signal
import statistics
import struct
import sys
import termios
import time
from pathlib import Path

READY = re.compile(rb"\xc2\xb7 (onnxruntime|torch) (cpu|cuda)")  # "· onnxruntime cpu": the status bar's model line


def one_start(argv: list[str], timeout: float) -> float:
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat, in a 120x40 terminal
        os.environ["TERM"] = "xterm-256color"
        os.execvp(argv[0], argv)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    start = time.perf_counter()
    seen = b""
    try:
        while time.perf_counter() - start < timeout:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if not ready:
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            seen = (seen + data)[-4096:]
            if READY.search(seen):
                return time.perf_counter() - start
        raise SystemExit(f"the chat did not become ready in {timeout:.0f} s; last output: {seen[-300:]!r}")
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("extra", nargs="*", help="arguments for edgespec chat (after --)")
    args = ap.parse_args()
    exe = Path(sys.executable).with_name("edgespec")
    argv = [str(exe), "chat", *args.extra]
    os.environ.setdefault("EDGESPEC_DATA", "/tmp/edgespec-chat-startup")
    times = [one_start(argv, args.timeout) for _ in range(args.repeats)]
    print(f"`{' '.join(['edgespec', *argv[1:]])}`: start -> model line in the status bar, {args.repeats} starts")
    print(f"median {statistics.median(times):.2f} s (runs {', '.join(f'{t:.2f}' for t in times)})")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
