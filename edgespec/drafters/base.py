"""The drafter protocol (`begin`, `propose`, `commit`), its optional capabilities, and `DrafterBase`.

A drafter owns its own state (a KV cache, a token history) and its own device, but hands the engine CPU rows
(`Draft.p_draft`, `peek`) and draws with the CPU generator it is given. It returns only new tokens.
It never sees the target's distributions; the engine tells it what was accepted through `commit`.

Everything the engine calls is declared in `Drafter`. What only some drafters can do is said by three flags,
never discovered by `hasattr`:
- `free`: a proposal costs microseconds and changes no state (an n-gram lookup), so the engine may consult it
  while the policy has speculation off and tell the policy how it would have fared (`KPolicy.observe_shadow`).
- `can_draft_ahead`: `prefill` and `propose_ahead` do real work, so an overlapped engine runs them on the
  drafter's own thread while the target works, and `peek` tells what was drafted ahead.
- `uses_p_min`: proposals honour `p_min` (stop after a token the draft model gave less than that probability)
  and `stop_ids` (never draft past an end of answer). A lookup has no confidence of its own and ignores both.

`DrafterBase` gives every capability its "cannot" default; a new drafter subclasses it and implements
`begin`, `propose`, `commit` and `reset`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import SamplingParams


@dataclass
class Draft:
    """Proposed tokens. `p_draft` is [len(tokens), V] float32 on the CPU (the device contract in
    `edgespec.target`: the rule runs there, whatever device the draft model runs on) when the tokens were
    sampled from a distribution; None when the proposal is deterministic (greedy, or a lookup), which the
    sampling rule treats as a one-hot distribution on each token."""

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


@runtime_checkable
class Drafter(Protocol):
    name: str
    description: str
    vocab_size: int | None  # rows of its distributions; None: it proposes ids from the context (a lookup)
    free: bool
    can_draft_ahead: bool
    uses_p_min: bool
    stop_ids: frozenset[int]  # end-of-answer ids (the engine sets them from the target's EOS ids)

    @property
    def lag(self) -> int:
        """Committed tokens the drafter must still feed before it can draft (a draft model's lazy prefill):
        K policies weigh that one-off cost against what drafting would save."""

    def begin(self, prompt_ids: list[int]) -> None:
        """Start a new request whose context is `prompt_ids`."""

    def propose(self, k: int, params: SamplingParams, generator: torch.Generator, *, p_min: float = 0.0) -> Draft:
        """Propose up to `k` tokens continuing the committed context (fewer, even none, is allowed). With
        `uses_p_min`, stop after a token drafted with less than `p_min` probability."""

    def commit(self, n_accepted: int, next_token: int) -> None:
        """The first `n_accepted` proposed tokens were kept, then the target added `next_token`."""

    def reset(self) -> None:
        """Drop all state (the next `begin` starts cold)."""

    def prefill(self) -> None:
        """Take in the committed context now rather than lazily at the first proposal (`can_draft_ahead`)."""

    def propose_ahead(self, total: int, params: SamplingParams, generator: torch.Generator, *,
                      p_min: float = 0.0) -> tuple[int, float]:
        """Draft on as if everything proposed so far will be accepted, to `total` tokens past the committed
        context (`can_draft_ahead`). Returns the tokens drafted and the seconds of that spent catching up."""

    def peek(self, i: int) -> tuple[int, torch.Tensor | None] | None:
        """The token drafted at position `i` past the committed context and its distribution row (None when
        greedy); None when nothing was drafted that far."""


class DrafterBase:
    """The defaults of `Drafter`: no capability beyond `begin`/`propose`/`commit`/`reset`."""

    name = "drafter"
    description = "drafter"
    vocab_size: int | None = None
    free = False
    can_draft_ahead = False
    uses_p_min = False
    stop_ids: frozenset[int] = frozenset()
    lag = 0

    def prefill(self) -> None:
        pass  # nothing to take in ahead of time

    def propose_ahead(self, total: int, params: SamplingParams, generator: torch.Generator, *,
                      p_min: float = 0.0) -> tuple[int, float]:
        raise NotImplementedError(f"{self.name} cannot draft ahead (can_draft_ahead is False)")

    def peek(self, i: int) -> tuple[int, torch.Tensor | None] | None:
        return None
