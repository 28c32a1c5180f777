"""The Python API (`edgespec.load`) on tiny checkpoints: answers as `edgespec generate` gives them, text pieces by
origin, per-request settings, one request at a time in arrival order, cancellation, prefix reuse across turns."""

import threading
import time

import pytest

import edgespec
from edgespec.api import FairLock, RequestError
from edgespec.drafters import ModelDrafter
from edgespec.errors import EdgespecError

TORCH = {"target_backend": "torch", "draft_backend": "torch"}  # no ONNX export: keeps these tests fast
CAP = 120.0


def wait_until(predicate, what: str, cap: float = CAP) -> None:
    """Poll `predicate` until it holds (no fixed sleeps: a generous cap for a loaded machine)."""
    end = time.monotonic() + cap
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return edgespec.load(target=str(tiny_checkpoints["target"]), draft=str(tiny_checkpoints["draft"]), k=3,
                         progress=lambda _: None, **TORCH)


def test_generate_equals_the_cli_and_pieces_carry_their_origin(model, tiny_checkpoints, capsys):
    import json

    from edgespec.cli import main

    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    assert main(["generate", "--target-backend", "torch", "--draft-backend", "torch", "--target", t, "--draft", d,
                 "--k", "3", "--prompt", "hello world", "--max-new-tokens", "24", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    c = model.generate("hello world", max_tokens=24)
    assert c.token_ids == cli["token_ids"] and c.text == cli["text"]
    assert c.metrics.to_dict()["k_per_round"] == cli["metrics"]["k_per_round"]
    assert c.drafter == "torch" and c.stop_reason in ("eos", "length") and c.prompt_tokens == cli["prompt_tokens"]
    assert "".join(t for t, _ in c.pieces) == c.text


def test_streamed_pieces_are_tagged_by_origin(tiny_checkpoints):
    t = str(tiny_checkpoints["target"])
    selfdraft = edgespec.load(target=t, draft=t, k=3, progress=lambda _: None, **TORCH)  # every draft accepted
    chunks = list(selfdraft.stream("hello world", max_tokens=24))
    pieces = [p for c in chunks for p in c.pieces]
    assert {o for _, o in pieces} == {"draft", "target"}
    for c in chunks[:-1]:  # a round: the accepted drafts' text, then the target's own token
        assert [o for _, o in c.pieces] in (["draft", "target"], ["target"], ["draft"], [])
        assert c.token_ids and len(c.token_ids) <= 4
    drafted = "".join(text for text, o in pieces if o == "draft")
    m = chunks[-1].metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 0
    assert 0 < len(drafted) <= m.num_emitted_from_draft  # one character a token for this tokenizer


def test_per_request_speculation_k_and_drafter(model):
    base = model.generate("the cat sat", max_tokens=20)
    off = model.generate("the cat sat", max_tokens=20, speculation=False)
    assert off.token_ids == base.token_ids and off.drafter == "none" and off.metrics.num_drafts == 0
    k1 = model.generate("the cat sat", max_tokens=20, k=1)
    assert k1.token_ids == base.token_ids and max(k1.metrics.k_per_round) == 1
    ngram = model.generate("the cat sat", max_tokens=20, drafter="ngram")
    assert ngram.token_ids == base.token_ids and ngram.drafter == "ngram"
    assert model.plain_tokens_per_s is not None  # the plain request measured the target alone
    again = model.generate("the cat sat", max_tokens=20)
    assert again.speedup is not None and again.speedup > 0  # so later drafted answers know their speed-up


def test_a_drafter_without_a_draft_model_is_a_request_error(tiny_checkpoints):
    alone = edgespec.load(target=str(tiny_checkpoints["target"]), k=2, progress=lambda _: None, **TORCH)
    assert alone.drafter == "ngram"
    with pytest.raises(RequestError) as err:
        alone.generate("hi", max_tokens=4, drafter="int8")
    assert err.value.param == "drafter" and "ngram" in str(err.value)
    assert alone.generate("hi", max_tokens=4).token_ids  # and the model still answers


@pytest.mark.parametrize("settings, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "8"}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"seed": -1}, "seed"), ({"stop": [1]}, "stop"), ({"k": 17}, "k"), ({"k": "many"}, "k"),
    ({"speculation": "yes"}, "speculation"), ({"drafter": "gpt"}, "drafter"),
])
def test_bad_settings_name_their_field(model, settings, param):
    with pytest.raises(RequestError) as err:
        model.stream("hi", **settings)
    assert err.value.param == param and "\n" not in str(err.value)


def test_chat_needs_a_chat_template(model, untemplated_target):
    """`has_chat_template` says beforehand (the chat app checks it at start) what `chat` would refuse."""
    assert model.has_chat_template
    raw = edgespec.load(target=str(untemplated_target), draft="none", progress=lambda _: None, **TORCH)
    assert not raw.has_chat_template
    with pytest.raises(EdgespecError, match="no chat template"):
        raw.chat([{"role": "user", "content": "hi"}], max_tokens=4)
    assert raw.generate("hi", max_tokens=4).token_ids


def test_prompt_past_the_context_is_refused_before_it_waits(model):
    with pytest.raises(RequestError) as err:
        model.stream("a" * 2100)
    assert err.value.param == "prompt" and "context" in str(err.value)


def test_a_context_limit_ends_answers_at_it_and_refuses_longer_prompts(tiny_checkpoints):
    # its own model: the limit stays for every later request
    capped = edgespec.load(target=str(tiny_checkpoints["target"]), draft=str(tiny_checkpoints["draft"]), k=3,
                           overlap=True, progress=lambda _: None, **TORCH)
    d = capped.description
    assert (d["drafter"], d["k"], d["overlap"]) == ("torch", 3, True) and d["target"] and d["draft"]
    prompt = capped.encode("hello world")
    full = capped.generate(prompt, max_tokens=12)
    assert full.stop_reason == "length"  # no EOS within 12 tokens: the limit below is what ends the next one
    own = capped.max_context
    for bad in (1, 0, True, 2.5, "64"):
        with pytest.raises(RequestError, match="too small; give at least 2") as err:
            capped.limit_context(bad)
        assert err.value.param == "max_context"
    assert capped.max_context == own
    limit = len(prompt) + 10
    capped.limit_context(limit)
    capped.limit_context(own + 100)  # it only lowers
    assert capped.max_context == limit
    c = capped.generate(prompt, max_tokens=12)
    assert c.stop_reason == "context" and c.token_ids == full.token_ids[:10]
    with pytest.raises(RequestError, match=f"the model's context holds {limit}") as err:
        capped.stream(prompt + full.token_ids[:10])
    assert err.value.param == "prompt" and not capped.busy


def test_stop_strings_and_seeds(model):
    full = model.generate("the cat", max_tokens=30).text
    stop = full[3:5]
    cut = model.generate("the cat", max_tokens=30, stop=[stop])
    assert cut.stop_reason == "stop" and cut.text == full[: full.find(stop)]
    a = model.generate("the cat", max_tokens=16, temperature=0.9, seed=11)
    b = model.generate("the cat", max_tokens=16, temperature=0.9, seed=11)
    assert a.token_ids == b.token_ids
    assert len({tuple(model.generate("the cat", max_tokens=16, temperature=0.9, seed=s).token_ids)
                for s in range(4)}) > 1


def test_threads_run_one_at_a_time_in_arrival_order(model):
    prompts = ["first prompt", "second one", "third, last"]
    alone = [model.generate(p, max_tokens=12).token_ids for p in prompts]
    holder = model.stream("hold the device", max_tokens=40)
    next(holder)  # holding the device between rounds
    order, results = [], {}

    def run(i):
        s = model.stream(prompts[i], max_tokens=12)
        for chunk in s:
            if not order or order[-1] != i:
                order.append(i)
        results[i] = s.token_ids

    threads = []
    for i in range(3):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        wait_until(lambda: model.waiting == i + 1, f"request {i} in line")
    assert order == [] and model.busy
    for _ in holder:  # finish the holder: the line moves
        pass
    for t in threads:
        t.join(CAP)
    assert order == [0, 1, 2]  # one at a time (never interleaved), first come first served
    assert [results[i] for i in range(3)] == alone


def test_cancel_ends_a_request_at_the_next_round_and_takes_a_waiting_one_out_of_line(model):
    s = model.stream("the cat sat on", max_tokens=200, k=2)
    next(s)
    s.cancel()
    rest = list(s)
    assert len(rest) == 1 and rest[0].stop_reason == "cancelled" and s.stop_reason == "cancelled"
    assert len(s.token_ids) <= 2 * 3  # two rounds of at most K + 1 tokens

    holder = model.stream("hold the device", max_tokens=40)
    next(holder)
    cancel = threading.Event()
    waiting = model.stream("never runs", max_tokens=8, cancel=cancel)
    out = []
    t = threading.Thread(target=lambda: out.extend(waiting))
    t.start()
    wait_until(lambda: model.waiting == 1, "the request in line")
    cancel.set()
    t.join(CAP)
    assert waiting.stop_reason == "cancelled" and waiting.token_ids == [] and model.waiting == 0
    assert model.busy  # the holder still has the device
    holder.close()  # closing a stream frees the device at once
    assert not model.busy
    assert model.generate("next", max_tokens=4).token_ids


def test_a_follow_up_turn_prefills_only_its_new_part(model):
    lm = model.runtime.engine.target.lm
    fed = []
    real_feed = lm.feed

    def feed(ids, logits_for):
        fed.append((len(ids), logits_for))
        return real_feed(ids, logits_for)

    lm.feed = feed
    try:
        turn1 = [{"role": "user", "content": "hello there"}]
        a = model.chat(turn1, max_tokens=12)
        turn2 = [*turn1, {"role": "assistant", "content": a.text}, {"role": "user", "content": "and then?"}]
        prompt2 = model.encode_chat(turn2)
        fed.clear()
        b = model.chat(turn2, max_tokens=12)
    finally:
        del lm.feed
    assert b.prompt_tokens == len(prompt2)
    assert b.cached_tokens >= a.prompt_tokens  # the whole first prompt (and the answer as templated) was cached
    prefill = fed[0]
    assert prefill == (len(prompt2) - 1 - b.cached_tokens, 0)  # the first feed takes in only the new part


def test_a_failing_drafter_is_a_notice_in_the_completion(model, monkeypatch):
    alone = model.generate("hello world", max_tokens=24, speculation=False)
    calls, original = [], ModelDrafter.commit

    def broken_commit(self, n_accepted, next_token):
        calls.append(n_accepted)
        if len(calls) == 2:
            raise RuntimeError("draft cache out of step")
        original(self, n_accepted, next_token)

    monkeypatch.setattr(ModelDrafter, "commit", broken_commit)
    c = model.generate("hello world", max_tokens=24)
    assert c.token_ids == alone.token_ids
    assert len(c.notices) == 1 and "draft cache out of step" in c.notices[0]


def test_fair_lock_hands_over_in_order_and_a_cancelled_waiter_leaves():
    lock = FairLock(poll=0.01)
    assert lock.acquire()
    got, cancel = [], threading.Event()

    def wait(i, c=None):
        if lock.acquire(c):
            got.append(i)
            lock.release()
        else:
            got.append(-i)

    a = threading.Thread(target=wait, args=(1,))
    a.start()
    wait_until(lambda: lock.waiting == 1, "the first waiter")
    b = threading.Thread(target=wait, args=(2, cancel))
    b.start()
    wait_until(lambda: lock.waiting == 2, "the second waiter")
    cancel.set()
    b.join(CAP)
    assert got == [-2] and lock.waiting == 1
    lock.release()
    a.join(CAP)
    assert got == [-2, 1] and not lock.held


def test_load_refuses_unknown_options():
    with pytest.raises(EdgespecError) as err:
        edgespec.load(target="x", colour="red")
    assert "colour" in str(err.value)
