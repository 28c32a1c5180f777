"""Conversions and the ONNX Runtime backend on tiny random Llamas: GGUF -> checkpoint -> ONNX, logits
match torch, crop, the conversion cache, and the one-line errors.

Each export runs onnxruntime-genai's builder in a subprocess (a few seconds each), so the exports are built
once per session into a temporary EDGESPEC_CACHE and shared by the tests. The GGUF is written here with the
`gguf` package (llama.cpp's layout: Q8_0 blocks, rotary-permuted q/k rows, a byte-level BPE vocabulary).
"""

import json
import shutil
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny import save_tiny_checkpoint, tiny_llama
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from edgespec.convert import MANIFEST, gguf_to_hf, hf_to_onnx
from edgespec.errors import EdgespecError
from edgespec.lm import CausalLM, TorchLM
from edgespec.onnx_lm import OnnxLM
from edgespec.progress import BarLine, reporting_to

# hidden 64 and intermediate 128 are multiples of the INT4 block (32); head_dim 16 suits GroupQueryAttention.
HIDDEN = 64
CONTEXT = 512
PROMPT = [1, 7, 12, 30, 5, 5, 41, 9, 60, 3, 22, 17, 8, 71, 44, 6, 19]


def tiny_tied(seed: int = 3) -> LlamaForCausalLM:
    """A Llama whose LM head is its embedding (as in SmolLM2), which the builder handles differently."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT, initializer_range=0.3,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


GGUF_CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
GGUF_VOCAB = 256 + 2 + 3  # byte tokens, two merges, three specials
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, as byte-level BPE vocabularies spell them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [chars[b] for b in range(256)]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp stores q/k projections in (its rotary layout); transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Write `model` as a Q8_0 GGUF; return the state dict its dequantised weights should reproduce."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(byte_tokens() + ["he", "ll", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    w.add_token_types([1] * 258 + [3] * 3)
    w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(259)
    w.add_eos_token_id(260)
    w.add_chat_template(GGUF_CHAT_TEMPLATE)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    expected = {}

    def add(gguf_name, hf_name, permute_heads=None):
        array = state[hf_name]
        if array.ndim == 1:  # norms stay float32, as llama.cpp keeps them
            w.add_tensor(gguf_name, array)
            expected[hf_name] = torch.from_numpy(array)
            return
        stored = llama_cpp_permute(array, permute_heads) if permute_heads else array
        blocks = gguf.quants.quantize(stored, Q8_0)
        w.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=Q8_0)
        expected[hf_name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0))

    add("token_embd.weight", "model.embed_tokens.weight")
    add("output_norm.weight", "model.norm.weight")
    add("output.weight", "lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        add(gg + "attn_norm.weight", hf + "input_layernorm.weight")
        add(gg + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        add(gg + "attn_q.weight", hf + "self_attn.q_proj.weight", cfg.num_attention_heads)
        add(gg + "attn_k.weight", hf + "self_attn.k_proj.weight", cfg.num_key_value_heads)
        add(gg + "attn_v.weight", hf + "self_attn.v_proj.weight")
        add(gg + "attn_output.weight", hf + "self_attn.o_proj.weight")
        add(gg + "ffn_gate.weight", hf + "mlp.gate_proj.weight")
        add(gg + "ffn_up.weight", hf + "mlp.up_proj.weight")
        add(gg + "ffn_down.weight", hf + "mlp.down_proj.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """The tiny checkpoints and their ONNX exports, built once into a private cache."""
    root = tmp_path_factory.mktemp("onnx")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGESPEC_CACHE", str(root / "cache"))
        model = tiny_llama(vocab_size=96, seed=0, hidden=HIDDEN, max_pos=CONTEXT)
        hf = save_tiny_checkpoint(root / "untied", model)
        tied_hf = save_tiny_checkpoint(root / "tied", tiny_tied())
        gguf_path = root / "gguf" / "tiny.Q8_0.gguf"
        gguf_path.parent.mkdir()
        gguf_expected = write_tiny_gguf(gguf_path, tiny_llama(vocab_size=GGUF_VOCAB, seed=4, hidden=HIDDEN,
                                                              max_pos=CONTEXT))
        shown = []  # what a front end (the chat's loading view) is shown of the first conversions
        with reporting_to(shown.append):
            gguf_hf = gguf_to_hf(gguf_path)
            fp32 = hf_to_onnx(hf, precision="fp32")
        out = {
            "model": model,
            "hf": hf,
            "fp32": fp32,
            "shown": shown,
            "int4": hf_to_onnx(hf, precision="int4"),
            "int4_last": hf_to_onnx(hf, precision="int4", last_logits_only=True),
            "tied_int4": hf_to_onnx(tied_hf, precision="int4"),
            "gguf": gguf_path,
            "gguf_expected": gguf_expected,
            "gguf_hf": gguf_hf,
            "gguf_fp32": hf_to_onnx(gguf_hf, precision="fp32"),
            "cache": root / "cache",
        }
    # The private cache is set only while building: later tests (the real SmolLM2 ones) keep the shared cache.
    yield out


@pytest.fixture
def cache(exports, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(exports["cache"]))
    return exports["cache"]


def assert_one_line_error(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_onnx_lm_is_a_causal_lm(exports):
    lm = OnnxLM(exports["fp32"], threads=1)
    assert isinstance(lm, CausalLM)
    assert lm.vocab_size == 96
    assert lm.max_context == CONTEXT
    assert lm.length == 0
    assert "fp32" in lm.description
    assert lm.feed([], 0).shape == (0, 96)
    assert lm.feed(PROMPT, 0).shape == (0, 96)
    assert lm.length == len(PROMPT)
    lm.reset()
    assert lm.length == 0


def test_fp32_matches_torch_on_prefill_and_incremental_decoding(exports):
    torch_lm = TorchLM(exports["model"])
    onnx_lm = OnnxLM(exports["fp32"], threads=1)
    torch_lm.reset()
    expected = torch_lm.feed(PROMPT, len(PROMPT))
    got = onnx_lm.feed(PROMPT, len(PROMPT))
    assert got.dtype == torch.float32 and got.shape == (len(PROMPT), 96)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # One token at a time, then chunks that return fewer logits than tokens, as verification does.
    for chunk, logits_for in [([33], 1), ([34], 1), ([50, 51, 52], 3), ([53, 54, 55, 56], 2), ([57], 0)]:
        expected = torch_lm.feed(chunk, logits_for)
        got = onnx_lm.feed(chunk, logits_for)
        assert got.shape == (logits_for, 96)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert onnx_lm.length == torch_lm.length


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_crop_then_feed_equals_a_fresh_prefill(exports, precision):
    lm = OnnxLM(exports[precision], threads=1)
    fresh = OnnxLM(exports[precision], threads=1)
    lm.feed(PROMPT + [70, 71, 72, 73, 74], 5)
    lm.crop(len(PROMPT) - 3)
    assert lm.length == len(PROMPT) - 3
    got = lm.feed([80, 81, 82], 3)
    expected = fresh.feed(PROMPT[:-3] + [80, 81, 82], 3)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    lm.crop(lm.length)  # a no-op crop (everything accepted) keeps the cache as it is
    torch.testing.assert_close(lm.feed([9], 1), fresh.feed([9], 1), atol=0, rtol=0)
    with pytest.raises(ValueError):
        lm.crop(lm.length + 1)


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_crop_after_every_accept_length_then_feed_equals_a_fresh_prefill(exports, precision):
    """Rounds as the engine runs them, one per accept length n = 0..K: verify K drafts (the cache takes them
    all), crop to the n accepted, then the target's token. Each round's logits equal a fresh prefill's."""
    lm = OnnxLM(exports[precision], threads=1)
    fresh = OnnxLM(exports[precision], threads=1)
    context = list(PROMPT)
    lm.feed(context, 1)
    drafts = [70, 71, 72, 73, 74, 75]
    for n in range(len(drafts) + 1):
        start = lm.length
        lm.feed([t + n for t in drafts], len(drafts))
        lm.crop(start + n)
        assert lm.length == start + n
        context += [t + n for t in drafts[:n]] + [80 + n]
        got = lm.feed([80 + n], 1)
        fresh.reset()
        expected = fresh.feed(context, 1)
        assert lm.length == len(context)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"accepted {n}: {m}")


def test_cache_grows_past_its_first_allocation_and_keeps_its_contents(exports):
    lm = OnnxLM(exports["fp32"], threads=1)
    fresh = OnnxLM(exports["fp32"], threads=1)
    ids = [(7 * i) % 90 + 3 for i in range(400)]
    lm.feed(ids[:10], 0)
    lm.feed(ids[10:390], 0)  # well past the first buffer: it is reallocated with the cached part copied
    lm.crop(300)
    got = lm.feed(ids[300:310], 10)
    expected = fresh.feed(ids[:310], 10)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    with pytest.raises(ValueError):
        lm.feed(list(range(CONTEXT)), 1)  # past the model's context


def test_a_long_feed_runs_in_chunks_and_returns_the_rows_asked_for(exports):
    """A prefill longer than PREFILL_CHUNK runs as chunks (bounded logits memory): the rows asked for, across a
    chunk boundary, are those of the same tokens fed in short steps."""
    from edgespec.onnx_lm import PREFILL_CHUNK

    lm = OnnxLM(exports["fp32"], threads=1)
    ids = [(5 * i) % 90 + 3 for i in range(PREFILL_CHUNK + 40)]
    wanted = 60  # the last 60 rows: 20 in the first chunk, 40 in the second
    got = lm.feed(ids, wanted)
    assert got.shape == (wanted, lm.vocab_size) and lm.length == len(ids)
    steps = OnnxLM(exports["fp32"], threads=1)
    steps.feed(ids[:len(ids) - wanted], 0)
    expected = torch.cat([steps.feed(ids[i:i + 10], 10) for i in range(len(ids) - wanted, len(ids), 10)])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    lm.reset()
    assert lm.feed(ids, 0).shape == (0, lm.vocab_size) and lm.length == len(ids)


def test_int4_model_loads_and_tracks_fp32(exports):
    fp32 = OnnxLM(exports["fp32"], threads=1)
    int4 = OnnxLM(exports["int4"], threads=1)
    assert "int4" in int4.description
    a = fp32.feed(PROMPT, len(PROMPT))
    b = int4.feed(PROMPT, len(PROMPT))
    assert b.shape == a.shape and torch.isfinite(b).all()
    # Random weights with a wide init lose a lot to 4 bits (0.86 here), yet an unrelated model scores near 0.
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.75


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


def test_tied_embeddings_export_computes_the_tied_models_logits(exports):
    lm = OnnxLM(exports["tied_int4"], threads=1)
    torch_lm = TorchLM(tiny_tied())
    got = lm.feed(PROMPT, len(PROMPT))
    expected = torch_lm.feed(PROMPT, len(PROMPT))
    assert got.shape == expected.shape == (len(PROMPT), 96) and torch.isfinite(got).all()
    # INT4 costs random wide-init weights a lot (0.85 here, about as for the untied model), yet another model's
    # logits (as an export with some other head, or other weights, would give) score near 0 (0.03 here).
    assert _corr(got, expected) > 0.75
    other = TorchLM(tiny_tied(seed=4)).feed(PROMPT, len(PROMPT))
    assert _corr(got, other) < 0.3


def _files(directory: Path) -> dict:
    """Every path under `directory` with its inode, size and modification time: what any rewrite changes."""
    return {p.relative_to(directory): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in directory.rglob("*")}


def _nothing_may_run(monkeypatch) -> None:
    """From here on a builder subprocess or a model load fails the test: a cache hit needs neither."""
    import subprocess

    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit ran a conversion")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", types.SimpleNamespace(from_pretrained=refuse))


def test_exports_are_cached_by_content_and_options(exports, cache, monkeypatch):
    before = _files(cache / "converted" / "onnx")
    with monkeypatch.context() as patch:
        _nothing_may_run(patch)
        assert hf_to_onnx(exports["hf"], precision="fp32") == exports["fp32"]
    assert _files(cache / "converted" / "onnx") == before  # found, not rebuilt: no file written or replaced
    assert exports["int4"] != exports["fp32"]
    assert (exports["int4"] / MANIFEST).is_file()
    leftovers = [p.name for p in (cache / "converted" / "onnx").iterdir() if ".partial-" in p.name]
    assert leftovers == []


def test_an_incomplete_export_is_rebuilt(exports, cache, tmp_path):
    hf = tmp_path / "copy"
    shutil.copytree(exports["hf"], hf)
    onnx_dir = hf_to_onnx(hf, precision="fp32")
    # What a crash can leave: a result without its manifest, and a staging dir of a process now gone.
    (onnx_dir / MANIFEST).unlink()
    (onnx_dir / "model.onnx").write_bytes(b"half written")
    abandoned = onnx_dir.parent / f".{onnx_dir.name}.partial-999999999"
    abandoned.mkdir()
    assert hf_to_onnx(hf, precision="fp32") == onnx_dir
    assert (onnx_dir / MANIFEST).is_file()
    assert not abandoned.exists()
    OnnxLM(onnx_dir, threads=1).feed(PROMPT, 1)


def test_corrupt_onnx_file_is_a_one_line_error(exports, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(exports["fp32"], broken)
    (broken / "model.onnx").write_bytes(b"\x08\x07garbage" * 100)
    with pytest.raises(EdgespecError) as excinfo:
        OnnxLM(broken)
    assert_one_line_error(excinfo, str(broken / "model.onnx"), "edgespec prepare")


def test_missing_onnx_files_are_one_line_errors(exports, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(exports["fp32"], missing)
    (missing / "model.onnx.data").unlink()
    with pytest.raises(EdgespecError) as excinfo:
        OnnxLM(missing)
    assert_one_line_error(excinfo, "model.onnx", "edgespec prepare")
    (missing / "genai_config.json").unlink()
    with pytest.raises(EdgespecError) as excinfo:
        OnnxLM(missing)
    assert_one_line_error(excinfo, "genai_config.json", "edgespec prepare")
    with pytest.raises(EdgespecError) as excinfo:
        OnnxLM(tmp_path / "nowhere")
    assert_one_line_error(excinfo, "edgespec prepare")


def test_unknown_device_is_an_error(exports):
    with pytest.raises(EdgespecError):
        OnnxLM(exports["fp32"], device="tpu")


def test_builder_failure_is_a_one_line_error_and_leaves_nothing(exports, cache, tmp_path):
    hf = tmp_path / "unsupported"
    shutil.copytree(exports["hf"], hf)
    config = (hf / "config.json").read_text().replace("LlamaForCausalLM", "NoSuchModelForCausalLM")
    (hf / "config.json").write_text(config)
    with pytest.raises(EdgespecError) as excinfo:
        hf_to_onnx(hf, precision="fp32")
    assert_one_line_error(excinfo, "builder", "NoSuchModelForCausalLM")
    assert not [p for p in (cache / "converted" / "onnx").iterdir() if p.name.startswith("unsupported")]
    assert not [p for p in (cache / "converted" / "onnx").iterdir() if ".partial-" in p.name]


def test_bad_options_and_inputs_are_errors(exports, cache, tmp_path):
    with pytest.raises(EdgespecError):
        hf_to_onnx(exports["hf"], precision="int3")
    with pytest.raises(EdgespecError) as excinfo:
        hf_to_onnx(tmp_path, precision="fp32")
    assert_one_line_error(excinfo, "config.json")


def test_gguf_to_hf_dequantises_weights_and_keeps_the_tokenizer(exports, cache, monkeypatch):
    hf = exports["gguf_hf"]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    stored = json.loads((hf / "config.json").read_text())
    assert stored["dtype"] == "float16"  # see edgespec.convert's docstring for why
    assert "quantization_config" not in stored
    state = model.state_dict()
    for name, expected in exports["gguf_expected"].items():
        # Exact up to float16 rounding; a wrong q/k row order or a missed dequantisation is far off.
        torch.testing.assert_close(state[name], expected, atol=1e-6, rtol=2**-11)
    assert not model.config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.decode(tok("hello world").input_ids) == "hello world"
    assert tok("hello").input_ids[:2] == [256, 257]  # the merges survived
    assert tok.eos_token == "<|im_end|>"
    assert tok.chat_template == GGUF_CHAT_TEMPLATE
    assert model.generation_config.eos_token_id == 260
    # Cached: a second call finds the result without loading or writing anything.
    before = _files(hf.parent)
    with monkeypatch.context() as patch:
        _nothing_may_run(patch)
        assert gguf_to_hf(exports["gguf"]) == hf
    assert _files(hf.parent) == before


def test_a_first_conversion_says_where_the_cache_is_once_and_shows_one_bar_each(exports):
    shown = exports["shown"]
    notices = [line for line in shown if line.startswith("first start:")]
    assert len(notices) == 1 and str(exports["cache"]) in notices[0] and "EDGESPEC_CACHE" in notices[0]
    bars = {}
    for line in shown:
        if isinstance(line, BarLine):
            bars.setdefault(line.key, []).append(str(line))
    assert len(bars) == 2, bars  # the dequantisation and the export: one bar each, redrawn in place
    dequantise, export = bars.values()
    assert dequantise[0].startswith("dequantising tiny.Q8_0.gguf:") and "tensors" in dequantise[-1]
    assert "100%" in dequantise[-1] and "left" in dequantise[-1]
    assert export[0].startswith(f"exporting {exports['hf'].name}: reading layers") and "layers" in export[0]


def test_gguf_checkpoint_exports_to_onnx_that_matches_torch(exports):
    torch_lm = TorchLM(AutoModelForCausalLM.from_pretrained(exports["gguf_hf"], dtype=torch.float32))
    onnx_lm = OnnxLM(exports["gguf_fp32"], threads=1)
    torch_lm.reset()
    ids = [259, 72, 256, 257, 111, 260, 5, 9]
    torch.testing.assert_close(onnx_lm.feed(ids, len(ids)), torch_lm.feed(ids, len(ids)), atol=1e-4, rtol=1e-4)
    assert onnx_lm.eos_token_ids == [260]

def test_llama_cpp_runs_the_tiny_gguf_as_its_dequantised_checkpoint_does(exports):
    """The llama.cpp backend on a GGUF written here: its logits are those of transformers on the dequantised
    weights (llama.cpp also quantises activations for Q8_0 matmuls: close, not equal), and crop + feed equals a
    fresh prefill."""
    pytest.importorskip("llama_cpp")
    from edgespec.llamacpp_lm import LlamaCppLM

    lm = LlamaCppLM(exports["gguf"], threads=1)
    assert lm.vocab_size == GGUF_VOCAB and lm.max_context == CONTEXT
    ref = TorchLM(AutoModelForCausalLM.from_pretrained(exports["gguf_hf"], dtype=torch.float32))
    ref.reset()
    expected = ref.feed(PROMPT, len(PROMPT))
    got = lm.feed(PROMPT, len(PROMPT))
    # measured 0.9997 (another model's logits correlate at ~0.03; a random tiny model's near-ties make argmax no test)
    assert _corr(got, expected) > 0.995
    lm.crop(10)
    again = lm.feed(PROMPT[10:], len(PROMPT) - 10)
    torch.testing.assert_close(again, got[10:], atol=1e-3, rtol=1e-3)



@pytest.mark.parametrize("content", [b"", b"not a gguf file at all\n", b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40])
def test_gguf_to_hf_rejects_files_that_are_not_gguf(cache, tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(EdgespecError) as excinfo:
        gguf_to_hf(path)
    assert_one_line_error(excinfo, "model.gguf", "not a valid GGUF file", "edgespec prepare")


def test_gguf_to_hf_missing_file(cache, tmp_path):
    with pytest.raises(EdgespecError) as excinfo:
        gguf_to_hf(tmp_path / "absent.gguf")
    assert_one_line_error(excinfo, "absent.gguf", "edgespec prepare")


# ---- the ONNX backends inside the engine: greedy speculation is identical to target-only -------------------

def _greedy(target, drafter, prompt, k, n=40, *, counts=None):
    """Greedy tokens of the target with `drafter` at a fixed K. Fails on any fallback to the target alone: a
    notice of a failed drafter, or a round before the last that did not ask the drafter (K = 0 after a failure).
    `counts`: a list to add this run's (accepted, drafted) token counts to."""
    from edgespec.engine import SpeculativeEngine
    from edgespec.metrics import SpecMetrics
    from edgespec.policy import FixedK

    tokens, metrics = [], SpecMetrics()
    for step in SpeculativeEngine(target, drafter).generate(prompt, max_new_tokens=n, policy=FixedK(k)):
        assert step.notice is None, step.notice
        tokens += step.tokens
        metrics.add(step)
    if drafter is not None and k > 0:
        assert 0 not in metrics.k_per_round[:-1], metrics.k_per_round
    if counts is not None:
        counts.append((metrics.num_accepted_tokens, metrics.num_draft_tokens))
    return tokens


def test_last_logits_only_export_gives_the_full_heads_last_row(exports):
    """A drafter's export prunes the LM head to the last position: same last row, one row only."""
    full = OnnxLM(exports["int4"], threads=1)
    last = OnnxLM(exports["int4_last"], threads=1)
    assert last.last_logits_only and not full.last_logits_only
    for chunk in (PROMPT, [33], [50, 51, 52]):
        expected = full.feed(chunk, 1)
        got = last.feed(chunk, 1)
        assert got.shape == (1, 96)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert last.feed([60, 61], 0).shape == (0, 96)
    assert last.length == full.length + 2
    with pytest.raises(ValueError, match="last position's logits only"):
        last.feed([62, 63], 2)


@pytest.mark.parametrize("draft_precision", ["fp32", "int4", "int4_last"])
def test_onnx_drafter_greedy_equals_target_only(exports, draft_precision):
    from edgespec.drafters import ModelDrafter
    from edgespec.target import TorchTarget

    target = TorchTarget(exports["model"])
    drafter = ModelDrafter(OnnxLM(exports[draft_precision], threads=1), name=draft_precision)
    for prompt in ([1, 5, 9, 3], [1, 7, 7, 20, 11, 4, 9, 13]):
        expected = _greedy(target, None, prompt, 0)
        for k in (1, 3, 6):
            counts = []
            assert _greedy(target, drafter, prompt, k, counts=counts) == expected, (draft_precision, prompt, k)
            [(accepted, drafted)] = counts
            if draft_precision == "fp32":  # the target's own weights: every greedy draft is accepted
                assert accepted == drafted > 0, (prompt, k, counts)
            else:  # quantised: accepted often, never not at all
                assert 0 < accepted <= drafted, (draft_precision, prompt, k, counts)


def test_onnx_target_greedy_speculation_equals_its_target_only(exports):
    from edgespec.drafters import ModelDrafter, NgramDrafter
    from edgespec.target import ModelTarget

    target = ModelTarget(OnnxLM(exports["fp32"], threads=1))
    drafters = [ModelDrafter(OnnxLM(exports["int4"], threads=1)), NgramDrafter()]
    for prompt in ([1, 5, 9, 3], [1, 7, 7, 20, 11, 4, 9, 13]):
        expected = _greedy(target, None, prompt, 0)
        for drafter in drafters:
            for k in (2, 5):
                counts = []
                assert _greedy(target, drafter, prompt, k, counts=counts) == expected
                if drafter is drafters[0]:  # the target quantised: accepted often, never not at all
                    assert counts[0][0] > 0, (prompt, k, counts)


# ---- --exact: single steps through the kernels of a multi-token step -------------------------------------------

def _steps(lm, tokens, rows):
    lm.min_rows = rows
    lm.reset()
    lm.feed(PROMPT, 1)
    return torch.cat([lm.feed([t], 1) for t in tokens]), lm.length


@pytest.mark.parametrize("precision", ["int4", "fp32"])
def test_two_row_single_steps_give_the_rows_of_a_multi_token_step_bitwise(exports, precision):
    lm = OnnxLM(exports[precision], threads=2)
    tokens = [33, 50, 51, 7, 90, 12]
    stepped, length = _steps(lm, tokens, rows=2)
    assert length == len(PROMPT) + len(tokens)  # the repeated id's row is not kept
    lm.crop(len(PROMPT))
    block = lm.feed(tokens, len(tokens))
    assert torch.equal(stepped, block)  # bitwise: what makes greedy output independent of K
    # and after a crop the cache holds the same as after the block
    lm.crop(len(PROMPT) + 2)
    assert torch.equal(lm.feed([tokens[2]], 1), block[2:3])
    one_row, _ = _steps(lm, tokens, rows=1)
    torch.testing.assert_close(one_row, block, atol=1e-3, rtol=1e-3)  # same model, other rounding at most


def test_two_row_single_step_at_the_context_end_runs_as_one_row(exports):
    lm = OnnxLM(exports["int4"], threads=1, min_rows=2)
    lm.feed([i % 90 + 1 for i in range(CONTEXT - 1)], 0)
    assert lm.length == CONTEXT - 1
    assert lm.feed([9], 1).shape == (1, 96) and lm.length == CONTEXT


def test_exact_onnx_target_greedy_speculation_equals_its_target_only_bitwise(exports):
    from edgespec.drafters import ModelDrafter, NgramDrafter
    from edgespec.target import ModelTarget

    target = ModelTarget(OnnxLM(exports["int4"], threads=2, min_rows=2))
    # the same int4 weights, the model at full precision (drafts the target sometimes rejects), prompt lookup
    drafters = {"same": ModelDrafter(OnnxLM(exports["int4_last"], threads=1)),
                "other": ModelDrafter(OnnxLM(exports["fp32"], threads=1)), "ngram": NgramDrafter()}
    counts = {name: [] for name in drafters}
    for prompt in ([1, 5, 9, 3], [1, 7, 7, 20, 11, 4, 9, 13]):
        expected = _greedy(target, None, prompt, 0)
        for name, drafter in drafters.items():
            for k in (1, 3, 6):
                assert _greedy(target, drafter, prompt, k, counts=counts[name]) == expected
    assert all(0 < accepted for accepted, _ in counts["same"] + counts["other"]), counts
    # the full-precision drafter's rejected drafts took the rollback path (a partial accept) in some round
    assert any(accepted < drafted for accepted, drafted in counts["other"]), counts["other"]


def test_bench_exact_checks_against_the_exact_target_alone(cache, tmp_path, capsys):
    from edgespec.cli import main

    # room for the bench prompts (one token a character), a head size ORT's attention takes
    hf = save_tiny_checkpoint(tmp_path / "long", tiny_llama(vocab_size=96, seed=0, hidden=HIDDEN, max_pos=2048))
    out_dir = tmp_path / "out"
    args = ["bench", "--target", str(hf), "--target-backend", "onnx", "--draft", "ngram",
            "--drafters", "ngram", "--quick", "--categories", "code,rag", "--max-new-tokens", "10", "--k", "2",
            "--exact", "--out", str(out_dir)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Greedy check: every output equals target-only-exact's" in out
    data = json.loads(next(out_dir.glob("*.json")).read_text())
    assert set(data["summary"]["configs"]) == {"target-only", "target-only-exact", "ngram@2"}
    assert data["summary"]["reference"] == "target-only-exact" and data["settings"]["exact"] is True
    assert any("--exact: the greedy reference is target-only-exact" in n for n in data["notes"])
