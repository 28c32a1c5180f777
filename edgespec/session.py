"""A chat-shaped front to the engine: messages in, text pieces out, tagged by origin, with live metrics.

This is what the TUI (and any other front end) drives: it applies the model's chat template, runs the engine
with the settings of this turn, and turns each engine step into text pieces marked "draft" (accepted drafts)
or "target" (the target's own token). It holds no conversation history (the app does) and touches no UI.
Cancellation is cooperative: set the `cancel` event and the stream ends after the current round, leaving
the engine ready for the next request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from .engine import SpeculativeEngine
from .errors import EdgespecError
from .metrics import DRAFT, TARGET, Chunk, SpecMetrics
from .policy import FixedK, KPolicy, check_k
from .sampling import SamplingParams
from .text import TextStream


@dataclass(frozen=True)
class Settings:
    """Per-turn settings. `k` is an int, or "auto" once a profile-driven policy exists."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    k: int | str = 4
    speculation: bool = True
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    def with_(self, **changes) -> Settings:
        return replace(self, **changes)


@dataclass
class ChatSession:
    engine: SpeculativeEngine
    tokenizer: object
    target_description: str = "target"
    draft_description: str | None = None
    policy_factory: object = None  # callable(Settings) -> KPolicy; default FixedK(settings.k)
    last_metrics: SpecMetrics | None = field(default=None, init=False)

    def encode(self, messages: list[dict], system: str | None = None) -> list[int]:
        return encode_chat(self.tokenizer, messages, system)

    def policy(self, settings: Settings) -> KPolicy:
        if not settings.speculation or self.engine.drafter is None:
            return FixedK(0)
        if self.policy_factory is not None:
            return self.policy_factory(settings)
        return FixedK(check_k(int(settings.k)) if settings.k != "auto" else 4)

    def reply(self, messages: list[dict], settings: Settings, *, system: str | None = None,
              cancel: threading.Event | None = None) -> Iterator[Chunk]:
        """Stream the assistant's answer to `messages` (the last one from the user)."""
        metrics = SpecMetrics()
        self.last_metrics = metrics
        yield from stream_text(self.engine, self.tokenizer, self.encode(messages, system), settings,
                               self.policy(settings), cancel=cancel, metrics=metrics)


def encode_chat(tokenizer, messages: list[dict], system: str | None = None,
                missing: str = "edgespec chat needs an instruct/chat model") -> list[int]:
    """`messages` through the model's own chat template, ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise EdgespecError(f"this model's tokenizer has no chat template; {missing}")
    full = ([{"role": "system", "content": system}] if system else []) + list(messages)
    ids = tokenizer.apply_chat_template(full, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def stream_text(engine: SpeculativeEngine, tokenizer, prompt: list[int], settings: Settings, policy: KPolicy, *,
                cancel: threading.Event | None = None, metrics: SpecMetrics | None = None,
                text: TextStream | None = None) -> Iterator[Chunk]:
    """The engine's steps for `prompt` as text pieces tagged DRAFT or TARGET (every front end's one loop: the
    chat app through `ChatSession.reply`, the Python API and the server through `edgespec.api`). `text`: the
    caller's own `TextStream` (with `settings.stop`), to read the text so far should the loop be interrupted."""
    stream = text if text is not None else TextStream(tokenizer, settings.stop)
    metrics = metrics if metrics is not None else SpecMetrics()
    ids: list[int] = []
    for step in engine.generate(prompt, params=settings.params(), max_new_tokens=settings.max_new_tokens,
                                policy=policy, stop=stream.stop if settings.stop else None):
        metrics.add(step)
        split = len(ids) + step.n_from_draft
        ids.extend(step.tokens)
        pieces = []
        draft_text = stream.update(ids[:split])
        if draft_text:
            pieces.append((draft_text, DRAFT))
        target_text = stream.update(ids)
        if target_text:
            pieces.append((target_text, TARGET))
        reason = step.stop_reason
        if reason is None and cancel is not None and cancel.is_set():
            reason = "cancelled"
        if reason is not None:
            rest = stream.flush()
            if rest:
                pieces.append((rest, TARGET))
        yield Chunk(pieces, step.k, metrics, reason, token_ids=list(step.tokens), notice=step.notice)
        if reason is not None:
            return
