"""A scripted stand-in for `edgespec.api.Model` with fixed text and fixed metrics, for screenshots and snapshots.

`ScriptedModel.chat` replays one canned answer in rounds of "accepted drafts, then one target token",
with metrics computed from made-up but fixed timings, so a screenshot of the app is the same on every
machine. It runs no model and is not a benchmark: nothing it reports was measured.
"""

from __future__ import annotations

import re
import threading
import time

from edgespec.metrics import SpecMetrics

DEMO_PROMPT = "In two sentences: what does speculative decoding do?"
DEMO_ANSWER = (
    "Speculative decoding lets a small draft model guess the next few tokens, and the large target model "
    "checks all of those guesses in a single forward pass. Every guess the target agrees with is kept for "
    "free, so the answer is exactly what the target alone would write, only faster."
)
PLAIN_PROMPT = "Say hello in five words."
PLAIN_ANSWER = "Hello there, nice to meet you!"
# (prompt, speculation on?): the screenshot's A/B, a plain turn first, then the same models with a draft
DEMO_TURNS = [(PLAIN_PROMPT, False), (DEMO_PROMPT, True)]
ACCEPTED = [3, 4, 1, 4, 0, 2, 4, 3, 4, 1, 2, 4, 4, 0, 3, 4, 2, 4]  # drafts accepted per round, K = 4


def demo_tokens(text: str = DEMO_ANSWER) -> list[str]:
    """Word-ish tokens: each word with the space before it, punctuation on its own."""
    return re.findall(r" ?[A-Za-z']+| ?[^A-Za-z' ]", text)


class ScriptedModel:
    """Duck-types what the chat app uses of `edgespec.api.Model`: `chat(messages, system=, stream=True, cancel=,
    **settings)` and `description`."""

    description = {"target": "SmolLM2-360M-Instruct (cpu, fp32)", "draft": "SmolLM2-135M-Instruct (cpu, fp32)"}

    def __init__(self, answer: str = DEMO_ANSWER, *, delay_s: float = 0.0):
        self.answers = {PLAIN_PROMPT: PLAIN_ANSWER}  # any other prompt gets `answer`
        self.answer = answer
        self.delay_s = delay_s

    def chat(self, messages, *, system=None, stream: bool = False, cancel: threading.Event | None = None,
             speculation: bool = True, **settings):
        assert stream, "the app streams its answers"
        from edgespec.engine import Step
        from edgespec.api import DRAFT, TARGET, Chunk

        tokens = demo_tokens(self.answers.get(messages[-1]["content"], self.answer))
        metrics = SpecMetrics()
        k = 4 if speculation else 0
        i = 0
        r = 0
        elapsed = 0.030  # a fixed 30 ms prefill
        while i < len(tokens):
            n_acc = min(ACCEPTED[r % len(ACCEPTED)] if k else 0, len(tokens) - i - 1)
            emitted = tokens[i:i + n_acc + 1]
            elapsed += 0.070 if k else 0.047  # one verify pass (+ drafting) per round
            metrics.add(Step(tokens=emitted, n_from_draft=n_acc, k=k, n_drafted=k, n_accepted=n_acc, draft_ms=0.0,
                             verify_ms=0.0, prefill_ms=30.0 if r == 0 else 0.0, elapsed_s=elapsed))
            pieces = []
            if n_acc:
                pieces.append(("".join(emitted[:-1]), DRAFT))
            pieces.append((emitted[-1], TARGET))
            i += len(emitted)
            r += 1
            reason = "eos" if i >= len(tokens) else None
            if reason is None and cancel is not None and cancel.is_set():
                reason = "cancelled"
            yield Chunk(pieces, k, metrics, reason)
            if reason is not None:
                return
            if self.delay_s:
                time.sleep(self.delay_s)


def demo_factory(progress) -> ScriptedModel:
    progress("demo: no models loaded, the answer is scripted")
    return ScriptedModel()


async def play_demo(pilot, timeout: float = 30.0) -> None:
    """Drive a `ChatApp` built on `demo_factory` through `DEMO_TURNS` (for the screenshot and the snapshot
    test): a plain turn, speculation back on, a speculative turn, and a next prompt typed but not sent."""
    from .widgets import PromptInput

    app = pilot.app
    deadline = time.monotonic() + timeout

    async def until(predicate) -> None:
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError("the demo did not finish in time")
            await pilot.pause(0.01)

    prompt = app.query_one(PromptInput)
    prompt.cursor_blink = False
    await until(lambda: app.model is not None and not app.query("#loading"))
    for text, speculation in DEMO_TURNS:
        if app.settings_values["speculation"] != speculation:
            await pilot.press("f3")
        prompt.insert(text)
        await pilot.press("enter")
        await until(lambda: app.record.messages[-1]["role"] == "assistant" and not app.generating)
    prompt.insert("And what does K mean?")
    await pilot.pause()
