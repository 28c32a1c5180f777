"""K policies: how many tokens to draft in the next round.

A policy sees each finished round (`observe`) and answers `next_k()`. It does not draft, verify or time
anything itself. K = 0 means plain decoding for that round, through the same loop.
"""

from __future__ import annotations

from typing import Protocol

from .errors import EdgespecError

MAX_K = 16


def check_k(k: int) -> int:
    """A user-given K, validated: 0 (speculation off) up to MAX_K."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K:
        raise EdgespecError(f"K={k!r} is out of range; use an integer from 0 (no speculation) to {MAX_K}")
    return k


class KPolicy(Protocol):
    def next_k(self) -> int: ...

    def observe(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None: ...


class FixedK:
    """The same K every round."""

    def __init__(self, k: int):
        self.k = check_k(k)

    def next_k(self) -> int:
        return self.k

    def observe(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None:
        pass

    def __repr__(self) -> str:
        return f"FixedK({self.k})"
