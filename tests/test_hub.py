"""Your own models by Hugging Face hub id, from a local fake hub cache (never the network): resolved through
huggingface_hub's cache, a pair whose embeddings differ in size over one tokenizer (as Qwen2.5-7B's 152,064
rows with 0.5B's 151,936), the tokenizer check on content, `edgespec prepare --target --draft`, and the one-line
error for a model that is neither cached nor reachable."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import torch
from tiny import perturbed, save_tiny_checkpoint, tiny_llama

from edgespec.cli import main
from edgespec.errors import EdgespecError
from edgespec.loading import check_same_tokenizer, load_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TORCH = ["--target-backend", "torch", "--draft-backend", "torch"]


def narrowed(model, rows: int, scale: float = 0.2):
    """A close draft of `model` whose embedding and LM head keep only the first `rows` rows."""
    draft = tiny_llama(vocab_size=rows, seed=0, max_pos=model.config.max_position_embeddings)
    state = {k: v[:rows] if v.shape[0] == model.config.vocab_size else v
             for k, v in perturbed(model, scale).state_dict().items()}
    draft.load_state_dict(state)
    return draft


def cache_model(cache, repo: str, model, **kwargs):
    """`model` as huggingface_hub's cache holds a download of `repo`: models--org--name/{refs/main, snapshots/<commit>}."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    save_tiny_checkpoint(folder / "snapshots" / COMMIT, model, **kwargs)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return folder / "snapshots" / COMMIT


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache with a target (128 rows), a draft of it with 96 rows, and a draft whose tokenizer marks other
    special tokens; the tokenizer itself has 76 tokens."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    target = tiny_llama(vocab_size=128, seed=0, max_pos=256)
    with torch.no_grad():  # rows past the tokenizer, as a real model's padding: trained on nothing, rarely chosen
        target.lm_head.weight[96:] = 0
    return {"cache": cache,
            "target": cache_model(cache, "org/tiny-target", target),
            "draft": cache_model(cache, "org/tiny-draft", narrowed(target, 96)),
            "other_specials": cache_model(cache, "org/other-specials", narrowed(target, 96), special=("<|user|>",))}


@pytest.fixture(autouse=True)
def offline_hub(hub, monkeypatch, tmp_path):
    """The fake cache as huggingface_hub's, offline (it read both at import, so the constants are set too)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # `org/name` must not exist here as a folder


def one_error(err: str) -> str:
    """The one `edgespec: error:` line of a run (a warning may come before it), no traceback."""
    errors = [line for line in err.splitlines() if line.startswith("edgespec: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def run(capsys, *args):
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def generate(capsys, *args):
    code, out, err = run(capsys, "generate", *TORCH, "--prompt", "hello world", "--max-new-tokens", "24", "--json",
                         *args)
    assert code == 0, err
    return json.loads(out)


def test_hub_ids_run_from_the_cache_and_unequal_widths_give_the_targets_greedy_output(hub, capsys):
    pair = ["--target", "org/tiny-target", "--draft", "org/tiny-draft"]
    spec = generate(capsys, *pair, "--k", "3")
    alone = generate(capsys, "--target", "org/tiny-target", "--no-spec")
    assert spec["token_ids"] == alone["token_ids"]
    assert spec["metrics"]["num_drafts"] > 0 and spec["metrics"]["num_accepted_tokens"] > 0
    assert not spec["notices"]


def test_unequal_widths_sample_through_the_rule(hub, capsys):
    result = generate(capsys, "--target", "org/tiny-target", "--draft", "org/tiny-draft", "--k", "3",
                      "--temperature", "1.0", "--seed", "3")
    assert len(result["token_ids"]) == 24 and result["metrics"]["num_drafts"] > 0 and not result["notices"]
    assert max(result["token_ids"]) < 128


def test_the_tokenizers_are_compared_on_content_not_embedding_sizes(hub):
    target, draft = load_tokenizer(hub["target"]), load_tokenizer(hub["draft"])
    check_same_tokenizer(target, draft)  # 128 and 96 rows, one tokenizer
    with pytest.raises(EdgespecError, match=r"special tokens \(target only: \[\('<\|assistant\|>', 4\)\]"):
        check_same_tokenizer(target, load_tokenizer(hub["other_specials"]))


def test_a_draft_with_more_rows_than_the_target_is_a_one_line_error(hub, capsys):
    code, _, err = run(capsys, "generate", *TORCH, "--prompt", "x", "--target", "org/tiny-draft", "--draft",
                       "org/tiny-target")
    assert code == 2 and "draft 128 tokens, target 96" in one_error(err)


def test_a_model_neither_cached_nor_reachable_is_one_line_naming_the_fix(capsys):
    code, _, err = run(capsys, "generate", "--prompt", "x", "--target", "org/not-downloaded")
    error = one_error(err)
    assert code == 2 and "HF_HUB_OFFLINE" in error and "edgespec prepare --target org/not-downloaded" in error
    assert "hf download org/not-downloaded" in error


def test_an_existing_local_folder_is_not_taken_for_a_hub_id(hub, tmp_path, capsys):
    local = tmp_path / "org" / "tiny-target"
    save_tiny_checkpoint(local, tiny_llama(vocab_size=96, seed=9, max_pos=256))
    result = generate(capsys, "--target", "org/tiny-target", "--no-spec")
    alone = generate(capsys, "--target", str(local), "--no-spec")
    assert result["token_ids"] == alone["token_ids"]
    assert torch.tensor(result["token_ids"]).max() < 96


def test_prepare_converts_a_hub_pair_once(hub, capsys):
    code, out, err = run(capsys, "prepare", "--target", "org/tiny-target", "--draft", "org/tiny-draft")
    assert code == 0, err
    prepared = {what.strip(): path for what, path in (line.rsplit(None, 1) for line in out.splitlines())}
    assert set(prepared) == {"target (transformers)", "target (onnx fp32)", "draft (transformers)",
                             "draft (onnx int4)"}
    assert prepared["target (transformers)"] == str(hub["target"])
    assert "tiny-target-fp32-" in prepared["target (onnx fp32)"] and "tiny-draft-int4-" in prepared["draft (onnx int4)"]
    assert "first start:" in err  # the cache's place, said once
    code, again, err = run(capsys, "prepare", "--target", "org/tiny-target", "--draft", "org/tiny-draft")
    assert code == 0 and again == out and "exporting" not in err  # cached: nothing converted twice


def test_a_hub_download_shows_one_bar_of_bytes(capsys):
    """huggingface_hub opens three bars for a snapshot (files fetched, bytes received, bytes written) through the
    class it is given: of those, only the bytes received reach the front end, as one bar."""
    from huggingface_hub.utils.tqdm import _create_progress_bar, hf_thread_map

    from edgespec.models import _hub_bar
    from edgespec.progress import BarLine, reporting_to

    shown = []
    with reporting_to(shown.append):
        bar_class = _hub_bar("downloading org/model", True)
        received = _create_progress_bar(cls=bar_class, log_level=20, desc="Downloading bytes", total=0, initial=0,
                                        unit="B", unit_scale=True)
        written = _create_progress_bar(cls=bar_class, log_level=20, desc="Reconstructing (incomplete total...)",
                                       total=0, initial=0, unit="B", unit_scale=True)
        received.total = 2048
        hf_thread_map(lambda n: (received.update(n), written.update(n)), [1024, 1024], desc="Fetching 2 files",
                      max_workers=1, tqdm_class=bar_class)
        received.close()
        written.close()
    assert shown and all(isinstance(line, BarLine) for line in shown) and len({line.key for line in shown}) == 1
    assert shown[-1].startswith("downloading org/model: 100% 2.00k/2.00kB")
