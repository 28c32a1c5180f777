"""Counters for a generation, named like vLLM's speculative-decoding metrics.

`SpecMetrics` is filled from the engine's `Step`s and returned as data (`to_dict`); it prints nothing.
acceptance_rate = num_accepted_tokens / num_draft_tokens; tau = emitted tokens / target forward passes.
`Chunk` is one streamed round (text pieces tagged DRAFT or TARGET, with the metrics so far): it lives here, beside
its metrics, so that a front end without the engine (edgespec.remote) streams the same type as edgespec.session.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    num_drafts: int = 0  # rounds in which at least one token was drafted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: drafts proposed at position i
    asked_per_position: list[int] = field(default_factory=list)  # [i]: rounds whose K asked for position i
    num_target_forwards: int = 0  # verification passes, prefill excluded
    num_emitted_tokens: int = 0
    num_emitted_from_draft: int = 0
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    catch_up_ms: float = 0.0  # of draft_ms: the draft model's lazy prefill (context it had not seen yet)
    wall_s: float = 0.0
    k_per_round: list[int] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)  # e.g. the drafter failed: the rest on the target alone

    def add(self, step) -> None:
        """Account for one engine `Step`."""
        self.k_per_round.append(step.k)
        self.num_target_forwards += 1
        _count_first(self.asked_per_position, step.k)
        if step.n_drafted:
            self.num_drafts += 1
            self.num_draft_tokens += step.n_drafted
            self.num_accepted_tokens += step.n_accepted
            _count_first(self.drafted_per_position, step.n_drafted)
            # as long as the drafted counts, so acceptance_per_position covers every drafted position
            _count_first(self.accepted_per_position, step.n_accepted, size=step.n_drafted)
        self.num_emitted_tokens += len(step.tokens)
        self.num_emitted_from_draft += step.n_from_draft
        self.prefill_ms += step.prefill_ms
        self.draft_ms += step.draft_ms
        self.verify_ms += step.verify_ms
        self.catch_up_ms += step.catch_up_ms
        self.wall_s = step.elapsed_s
        if step.notice:
            self.notices.append(step.notice)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tau(self) -> float:
        return self.num_emitted_tokens / self.num_target_forwards if self.num_target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Emitted tokens over the wall time of the whole request, prefill included."""
        return self.num_emitted_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Emitted tokens over the time after prefill (what a user sees while text streams)."""
        decode_s = self.wall_s - self.prefill_ms / 1000
        return self.num_emitted_tokens / decode_s if decode_s > 0 else 0.0

    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "asked_per_position": list(self.asked_per_position),
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position(),
            "tau": self.tau,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_emitted_from_draft": self.num_emitted_from_draft,
            "num_target_forwards": self.num_target_forwards,
            "prefill_ms": self.prefill_ms,
            "draft_ms": self.draft_ms,
            "verify_ms": self.verify_ms,
            "catch_up_ms": self.catch_up_ms,
            "wall_s": self.wall_s,
            "k_per_round": list(self.k_per_round),
            "notices": list(self.notices),
        }


def _count_first(counts: list[int], n: int, *, size: int = 0) -> None:
    """Add one to counts[0..n-1], growing the list (to at least `size`) with zeros as needed."""
    counts.extend([0] * (max(n, size) - len(counts)))
    for i in range(n):
        counts[i] += 1


DRAFT = "draft"
TARGET = "target"


@dataclass
class Chunk:
    """What one engine round added: text pieces tagged DRAFT or TARGET, and the metrics so far."""

    pieces: list[tuple[str, str]]
    k: int
    metrics: SpecMetrics
    stop_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)  # the ids this round emitted
    notice: str | None = None  # e.g. the drafter failed: the rest of the answer on the target alone

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)
