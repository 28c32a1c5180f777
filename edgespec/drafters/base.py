"""The drafter protocol: `begin`, `propose`, `commit`.

A drafter owns its own state (a KV cache, a token history) and its own device. It returns only new tokens.
It never sees the target's distributions; the engine tells it what was accepted through `commit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling import SamplingParams


@dataclass
class Draft:
    """Proposed tokens. `p_draft` is [len(tokens), V] float32 when the tokens were sampled from a
    distribution; None when the proposal is deterministic (greedy, or a lookup), which the sampling rule
    treats as a one-hot distribution on each token."""

    tokens: list[int]
    p_draft: torch.Tensor | None = None
    # Seconds of this proposal spent catching up on context the drafter had not seen (the prompt on the first
    # round, the tokens of rounds decoded without drafting): a one-off cost, not a cost per drafted token.
    catch_up_s: float = 0.0
    catch_up_tokens: int = 0  # how many tokens that catch-up fed
    # Tokens this call ran the draft model for (None: all of `tokens`). An overlapped drafter may have drafted
    # some or all of them ahead, on its own thread, while the target verified the round before.
    drafted: int | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    name: str
    description: str
    # Optional `lag` (int): committed tokens the drafter must still feed before it can draft (a draft model's
    # prefill is lazy); K policies weigh that one-off cost against what drafting would save. Absent = 0.

    def begin(self, prompt_ids: list[int]) -> None:
        """Start a new request whose context is `prompt_ids`."""

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """Propose up to `k` tokens continuing the committed context (fewer, even none, is allowed). A drafter
        with a confidence of its own may also take `p_min=` (the engine passes it when the policy sets one):
        stop after a token it drafted with less than that probability."""

    def reset(self) -> None:
        """Drop all state (the next `begin` starts cold)."""

    def commit(self, n_accepted: int, next_token: int) -> None:
        """The first `n_accepted` proposed tokens were kept, then the target added `next_token`."""
