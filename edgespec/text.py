"""From generated token ids to streamed text, with stop strings.

Decoding the whole generated sequence each time (not token by token) keeps multi-byte characters and
tokenizers that merge spaces correct; text ending in an incomplete UTF-8 sequence is held back until the
next token completes it, and so is a tail that may still become a stop string. The engine never sees any of
this: it gets `TextStream.stop` as its `stop(ids) -> bool` callback.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop_strings: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.n_ids = 0
        self.text = ""  # decoded text so far, cut before the first stop string once one appears
        self.sent = 0  # characters already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> None:
        if self.stopped or len(ids) == self.n_ids:
            return
        self.n_ids = len(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
        self.text = text

    def stop(self, ids: list[int]) -> bool:
        """The engine's stop callback (`ids` = all generated ids): true once a stop string has appeared."""
        self._decode(ids)
        return self.stopped

    def update(self, ids: list[int]) -> str:
        """Given all generated ids so far, return the text that is newly safe to show."""
        self._decode(ids)
        ready = len(self.text)
        if not self.stopped:
            while ready > self.sent and self.text[ready - 1] == "\ufffd":
                ready -= 1
            for s in self.stop_strings:
                for n in range(min(len(s) - 1, ready - self.sent), 0, -1):
                    if self.text[ready - n:ready] == s[:n]:
                        ready -= n
                        break
        out = self.text[self.sent:ready]
        self.sent = ready
        return out

    def flush(self) -> str:
        """Everything not yet shown (call at the end of generation)."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out
