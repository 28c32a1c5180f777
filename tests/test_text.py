"""`edgespec.text.TextStream`: streamed text equals the tokenizer's decode of the whole answer, whatever the
steps' sizes, with multi-byte characters held back until whole and stop strings found across step boundaries,
while each step decodes only a short window (not the whole answer again)."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from edgespec.convert import gguf_meta
from edgespec.loading import load_tokenizer
from edgespec.models import load_manifest, resolve_model
from edgespec.text import TextStream

TEXTS = [
    "Héllo wörld! Ünïcode ça va? 日本語のテキスト、絵文字 🐉🍳 and a dragon who cooks. 🇫🇷 naïve café",
    "def f(x):\n    return x ** 2  # squares\n\n\tTabs and  double  spaces, ‘quotes’ — dashes…",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(gguf_meta(resolve_model(load_manifest("smollm2-135m").target)))


def _stream(tokenizer, ids, cuts, stop=()):
    stream, shown = TextStream(tokenizer, stop), []
    for end in [*cuts, len(ids)]:
        shown.append(stream.update(ids[:end]))
        if stream.stopped:
            break
    return "".join(shown) + stream.flush(), shown, stream


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_text_is_the_whole_decode_whatever_the_steps(tokenizer, data):
    text = data.draw(st.sampled_from(TEXTS))
    ids = tokenizer.encode(text, add_special_tokens=False)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=len(ids))))
    whole, shown, _ = _stream(tokenizer, ids, cuts)
    assert whole == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in shown)  # a character split over tokens is shown whole


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_stop_string_is_found_across_steps_and_cuts_the_text_before_it(tokenizer, data):
    text = data.draw(st.sampled_from(TEXTS))
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    start = data.draw(st.integers(1, len(full) - 4))
    stop = full[start:start + data.draw(st.integers(2, 4))]
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=len(ids))))
    whole, _, stream = _stream(tokenizer, ids, cuts, stop=[stop])
    assert stream.stopped and whole == full[:full.find(stop)]


def test_each_step_decodes_a_short_window_not_the_whole_answer(tokenizer):
    class Counting:
        def __init__(self, real):
            self.real, self.decoded = real, []

        def decode(self, ids, **kwargs):
            self.decoded.append(len(ids))
            return self.real.decode(ids, **kwargs)

    ids = tokenizer.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    counting = Counting(tokenizer)
    stream = TextStream(counting, ["never appears"])
    random.seed(0)
    end, text = 0, ""
    while end < len(ids):
        end = min(end + random.randint(1, 4), len(ids))
        text += stream.update(ids[:end])
    assert text + stream.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 500 and max(counting.decoded) <= 32  # (the whole answer: 1,840)
