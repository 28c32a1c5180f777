"""A GGUF that llama.cpp runs as it is is not converted: its tokenizer, chat template, config and generation config
go into a folder without weights (`convert.gguf_meta`), and its weights are dequantised (`convert.gguf_to_hf`)
only when a torch or ONNX model is made from them (`runtime._Source.weights`). On the tiny Q8_0 GGUF the ONNX
tests write, each in an empty cache of its own."""

import json
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from test_onnx import CONTEXT, GGUF_VOCAB, HIDDEN, write_tiny_gguf  # noqa: E402
from tiny import tiny_llama  # noqa: E402

from edgespec import cache as edgespec_cache  # noqa: E402
from edgespec.convert import MANIFEST, gguf_meta, gguf_to_hf  # noqa: E402
from edgespec.engine import SpeculativeEngine  # noqa: E402
from edgespec.errors import EdgespecError  # noqa: E402
from edgespec.llamacpp_lm import LlamaCppLM  # noqa: E402
from edgespec.loading import load_tokenizer  # noqa: E402
from edgespec.policy import FixedK  # noqa: E402
from edgespec.runtime import RuntimeSpec, _eos_ids, _Source, build_runtime, extra_drafter, prepare_pair  # noqa: E402
from edgespec.session import ChatSession  # noqa: E402
from edgespec.target import ModelTarget  # noqa: E402

MESSAGES = [{"role": "user", "content": "hello hello hello"}]
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".onnx", ".onnx.data")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf"
    write_tiny_gguf(path, tiny_llama(vocab_size=GGUF_VOCAB, seed=4, hidden=HIDDEN, max_pos=CONTEXT))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("EDGESPEC_CACHE", str(root))
    return root


@pytest.fixture
def pair(gguf, tmp_path):
    """A pair without a draft, like the embedded smollm2-135m: its own GGUF drafts for it."""
    path = tmp_path / "tinypair.toml"
    path.write_text(f'name = "tinypair"\ndescription = "test pair"\ndefault_drafters = ["int4", "ngram"]\n\n'
                    f'[target]\nformat = "gguf"\nonnx_precision = "fp32"\n\n'
                    f'[target.source]\nkind = "path"\npath = "{gguf}"\n')
    return str(path)


def weight_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]


def quiet(_line):
    pass


@pytest.mark.parametrize("draft", ["ngram", "none", "llamacpp"])
def test_a_llama_cpp_target_reads_the_gguf_metadata_and_writes_no_weights(gguf, cache, draft):
    spec = RuntimeSpec(target=str(gguf), target_backend="llamacpp", threads=2,
                       draft=str(gguf) if draft == "llamacpp" else draft, draft_backend="llamacpp")
    rt = build_runtime(spec, progress=quiet)
    assert rt.target_backend == "llamacpp" and rt.drafter_name == draft
    assert weight_files(cache) == []
    assert not (cache / "converted" / "hf").exists()
    metas = [p for p in (cache / "converted" / "meta").iterdir() if not p.name.startswith(".")]
    assert len(metas) == 1 and (metas[0] / MANIFEST).is_file()
    assert rt.target_source.hf_dir is None and rt.target_source.meta_dir == metas[0]
    assert {"tokenizer.json", "config.json", "generation_config.json", "chat_template.jinja"} <= \
        {p.name for p in metas[0].iterdir()}

    ids = ChatSession(rt.engine, rt.tokenizer).encode(MESSAGES)
    out = rt.engine.run(ids, max_new_tokens=24, policy=FixedK(3))
    assert len(out.token_ids) > 0 and not out.metrics.notices
    eos = rt.engine.eos_token_ids

    # What the full conversion gives, which the start used before: the same files but the weights, the same
    # prompt ids, EOS ids and greedy answer (plain llama.cpp decoding of the same file).
    hf = gguf_to_hf(gguf)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (metas[0] / name).read_bytes() == (hf / name).read_bytes(), name
    config = {k: v for k, v in json.loads((hf / "config.json").read_text()).items() if k != "dtype"}
    assert json.loads((metas[0] / "config.json").read_text()) == config
    tokenizer = load_tokenizer(hf)
    assert ChatSession(rt.engine, tokenizer).encode(MESSAGES) == ids
    assert _eos_ids(_Source(hf_dir=hf), tokenizer) == sorted(eos) == [260]
    plain = SpeculativeEngine(ModelTarget(LlamaCppLM(gguf, threads=2)), None, eos_token_ids=eos)
    assert plain.run(ids, max_new_tokens=24, policy=FixedK(0)).token_ids == out.token_ids


def test_a_torch_target_of_a_gguf_converts_its_weights(gguf, cache):
    rt = build_runtime(RuntimeSpec(target=str(gguf), target_backend="torch", draft="ngram"), progress=quiet)
    assert [p.suffix for p in weight_files(cache)] == [".safetensors"]
    assert rt.target_source.hf_dir is not None and rt.target_source.meta_dir is None
    assert not (cache / "converted" / "meta").exists()  # the checkpoint has the tokenizer: no second folder


def test_the_pairs_own_int4_drafter_converts_the_gguf_it_shares_with_a_llama_cpp_target(pair, cache):
    lines = []
    rt = build_runtime(RuntimeSpec(pair=pair, target_backend="llamacpp", draft="int4", threads=2),
                       progress=lines.append)
    assert rt.target_backend == "llamacpp" and rt.draft_source is rt.target_source
    names = {p.name for p in weight_files(cache)}
    assert "model.safetensors" in names and "model.onnx" in names
    assert not (cache / "converted" / "meta").exists()  # its weights were needed anyway: converted once, up front
    ids = ChatSession(rt.engine, rt.tokenizer).encode(MESSAGES)
    plain = rt.engine.run(ids, max_new_tokens=16, policy=FixedK(0)).token_ids
    assert rt.engine.run(ids, max_new_tokens=16, policy=FixedK(3)).token_ids == plain


def test_another_drafter_converts_the_weights_when_it_first_needs_them(pair, cache):
    rt = build_runtime(RuntimeSpec(pair=pair, target_backend="llamacpp", draft="ngram", threads=2), progress=quiet)
    assert weight_files(cache) == []
    assert extra_drafter(rt, "llamacpp") is not None and weight_files(cache) == []  # the GGUF as it is
    drafter = extra_drafter(rt, "torch")  # (as the API's per-request drafter and `edgespec profile` ask for one)
    assert drafter is not None and [p.suffix for p in weight_files(cache)] == [".safetensors"]
    assert rt.target_weights() == rt.target_source.hf_dir is not None
    ids = ChatSession(rt.engine, rt.tokenizer).encode(MESSAGES)
    plain = rt.engine.run(ids, max_new_tokens=16, policy=FixedK(0)).token_ids
    engine = SpeculativeEngine(rt.engine.target, drafter, eos_token_ids=rt.engine.eos_token_ids)
    assert engine.run(ids, max_new_tokens=16, policy=FixedK(3)).token_ids == plain


def test_prepare_converts_only_for_the_backend_this_machine_starts_on(pair, cache):
    prepared = prepare_pair(pair, drafters=("llamacpp",), progress=quiet)  # auto: llama.cpp is installed here
    assert set(prepared) == {"target (metadata)", "draft (metadata)"}
    assert weight_files(cache) == []  # no transformers or ONNX copy of the weights for a llama.cpp start
    onnx = prepare_pair(pair, drafters=("llamacpp",), backend="onnx", progress=quiet)
    assert {"target (transformers)", "target (onnx fp32)"} <= set(onnx)
    assert {p.name for p in weight_files(cache)} >= {"model.safetensors", "model.onnx"}


def test_prepare_leaves_a_llama_cpp_start_nothing_to_convert(pair, cache):
    prepared = prepare_pair(pair, drafters=("llamacpp",), backend="all", progress=quiet)
    assert {"target (metadata)", "target (transformers)", "draft (metadata)"} <= set(prepared)
    assert prepared["target (metadata)"] == prepared["draft (metadata)"]  # one GGUF, one folder
    lines = []
    build_runtime(RuntimeSpec(pair=pair, target_backend="llamacpp", draft="llamacpp", threads=2),
                  progress=lines.append)
    assert not [line for line in lines if "once; cached in" in line], lines


def test_the_cache_listing_names_metadata_folders(gguf, cache):
    folder = gguf_meta(gguf)
    assert gguf_meta(gguf) == folder  # cached: the second call finds it
    entry = next(e for e in edgespec_cache.entries() if e.path == folder)
    assert entry.kind == "conversion" and entry.what == "metadata (no weights)" and folder / MANIFEST in entry.files
    assert "metadata (no weights)" in edgespec_cache.listing([entry])
    freed, left = edgespec_cache.remove(entry)
    assert freed > 0 and left == [] and not folder.exists()


def test_a_garbled_gguf_is_a_one_line_error(tmp_path, cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(EdgespecError, match="not a valid GGUF file") as err:
        build_runtime(RuntimeSpec(target=str(bad), target_backend="llamacpp", draft="ngram"), progress=quiet)
    assert "\n" not in str(err.value)
