"""`edgespec generate` end to end on tiny checkpoints, and its one-line errors."""

import json
import subprocess
import sys

import pytest

from edgespec.cli import main


def run_cli(*args):
    """The CLI in a subprocess, as a user runs it: exit code, stdout, stderr."""
    if args and args[0] == "generate":
        args = ("generate", *TORCH, *args[1:])
    proc = subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


TORCH = ["--target-backend", "torch", "--draft-backend", "torch"]  # no ONNX export: keeps these tests fast


def generate_json(capsys, *args):
    assert main(["generate", *TORCH, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_interface_and_greedy_equivalence(tiny_checkpoints, capsys):
    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    base = ["--target", t, "--prompt", "hello world", "--max-new-tokens", "24"]
    plain = generate_json(capsys, *base, "--no-spec")
    assert plain["metrics"]["num_drafts"] == 0 and len(plain["token_ids"]) <= 24
    for draft in (d, "ngram"):
        spec = generate_json(capsys, *base, "--draft", draft, "--k", "3")
        assert spec["token_ids"] == plain["token_ids"]
        assert spec["text"] == plain["text"]
        m = spec["metrics"]
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                    "acceptance_rate", "tau", "tokens_per_s", "draft_ms", "verify_ms", "k_per_round"):
            assert key in m
        assert spec["stop_reason"] in ("eos", "length")


def test_chat_template_and_sampling_seed(tiny_checkpoints, capsys):
    t = str(tiny_checkpoints["target"])
    args = ["--target", t, "--prompt", "hi", "--chat", "--temperature", "0.8", "--top-p", "0.9", "--seed", "7",
            "--max-new-tokens", "12", "--draft", str(tiny_checkpoints["draft"]), "--k", "3"]
    a = generate_json(capsys, *args)
    b = generate_json(capsys, *args)
    assert a["token_ids"] == b["token_ids"]  # a seed (with a fixed K) makes sampling reproducible
    assert a["prompt_tokens"] > len("hi")  # the template added role markers


def test_streaming_text_matches_json(tiny_checkpoints):
    t = str(tiny_checkpoints["target"])
    code, out, err = run_cli("generate", "--target", t, "--prompt", "abc abc", "--max-new-tokens", "16")
    assert code == 0, err
    code, js, _ = run_cli("generate", "--target", t, "--prompt", "abc abc", "--max-new-tokens", "16", "--json")
    assert out.rstrip("\n") == json.loads(js)["text"]
    assert "tok/s" in err


def test_stop_string_cuts_text(tiny_checkpoints, capsys):
    t = str(tiny_checkpoints["target"])
    full = generate_json(capsys, "--target", t, "--prompt", "the cat", "--max-new-tokens", "30")["text"]
    assert len(full) > 4
    stop = full[3:5]
    cut = generate_json(capsys, "--target", t, "--prompt", "the cat", "--max-new-tokens", "30", "--stop", stop)
    assert cut["stop_reason"] == "stop"
    assert cut["text"] == full[: full.find(stop)]


def one_line_error(code, err, *needles):
    """Exit status 2 and exactly one error line naming the problem; other stderr lines are progress notes."""
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("edgespec: error:")]
    assert len(errors) == 1, err
    assert all(line.startswith("edgespec: ") for line in lines), err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def test_error_vocab_mismatch(tiny_checkpoints):
    code, _, err = run_cli("generate", "--target", str(tiny_checkpoints["target"]),
                           "--draft", str(tiny_checkpoints["other_vocab"]), "--prompt", "x")
    one_line_error(code, err, "96", "128")


def test_error_missing_path(tmp_path):
    code, _, err = run_cli("generate", "--target", str(tmp_path / "nope"), "--prompt", "x")
    one_line_error(code, err, "does not exist")


def test_error_not_decoder_only(tmp_path):
    from transformers import T5Config

    T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    code, _, err = run_cli("generate", "--target", str(tmp_path), "--prompt", "x")
    one_line_error(code, err, "decoder-only")


def test_error_prompt_longer_than_context(tiny_checkpoints):
    code, _, err = run_cli("generate", "--target", str(tiny_checkpoints["target"]), "--prompt", "a" * 2100)
    one_line_error(code, err, "context")


@pytest.mark.parametrize("k", ["-1", "99"])
def test_error_bad_k(tiny_checkpoints, k):
    code, _, err = run_cli("generate", "--target", str(tiny_checkpoints["target"]), "--prompt", "x", "--k", k)
    one_line_error(code, err, "K=")


@pytest.mark.parametrize("p_min", ["1.5", "-0.2", "high"])
def test_error_bad_p_min(tiny_checkpoints, p_min):
    code, _, err = run_cli("generate", "--target", str(tiny_checkpoints["target"]), "--prompt", "x", "--p-min", p_min)
    one_line_error(code, err, "--p-min", "from 0")


def test_p_min_keeps_the_answer_and_shortens_drafts(tiny_checkpoints, capsys):
    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    base = ["--target", t, "--draft", d, "--prompt", "hello world", "--max-new-tokens", "24", "--k", "4"]
    full = generate_json(capsys, *base)
    cut = generate_json(capsys, *base, "--p-min", "0.99")
    assert cut["token_ids"] == full["token_ids"]
    assert cut["metrics"]["num_draft_tokens"] < full["metrics"]["num_draft_tokens"]


def test_error_cuda_missing(tiny_checkpoints):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run_cli("generate", "--target", str(tiny_checkpoints["target"]), "--prompt", "x", "--device", "cuda")
    one_line_error(code, err, "CUDA", "cpu")


def test_error_corrupt_weights(tiny_checkpoints, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["target"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    code, _, err = run_cli("generate", "--target", str(broken), "--prompt", "x")
    one_line_error(code, err, "corrupt")


def test_error_profile_with_exact(tiny_checkpoints, capsys):
    assert main(["profile", "--target", str(tiny_checkpoints["target"]), "--exact", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop --exact" in err[0] and err[0].startswith("edgespec: error:")


def test_profile_end_to_end_on_tiny_models_measures_the_drafters_prefill(tiny_checkpoints, tmp_path):
    from edgespec import profiling

    out = tmp_path / "tiny.toml"
    assert main(["profile", "--target", str(tiny_checkpoints["target"]), "--target-backend", "torch",
                 "--draft", str(tiny_checkpoints["draft"]), "--draft-backend", "torch",
                 "--quick", "--k-max", "2", "--out", str(out)]) == 0
    prof = profiling.read_profile(out)
    assert prof.data["settings"]["typical_prompt_tokens"] > 100  # the calibration prompts, one token a char
    # Taking in a 256-token context costs a model drafter real time; the n-gram lookup nothing to speak of.
    assert prof.catch_up_ms("torch") > prof.catch_up_ms("ngram") >= 0
    # Two or more cores: the models are measured again with the cores split as --overlap runs them.
    overlap = prof.data.get("overlap")
    assert (overlap is not None) == (prof.data["machine"]["cores_usable"] >= 2)
    for band in profiling.BANDS:
        assert {"drafter", "k", "speedup", "request_speedup"} <= set(prof.choice(band))
    if overlap:
        assert overlap["draft_threads"] >= 1 and set(overlap["drafters"]) == {"torch"}  # n-gram has nothing to overlap
        assert len(overlap["verify"]) == 4 and all(t > 0 for t in overlap["verify"][1:])
        # the split latencies were taken with the other model working beside; the prefills of a typical prompt
        # on every core and split (the draft model taking it in beside the target) are both measured
        assert overlap["concurrent"] is True
        assert prof.data["latency"]["prefill_tokens"] == prof.data["settings"]["typical_prompt_tokens"]
        assert prof.data["latency"]["prefill_ms"] > 0 and overlap["drafters"]["torch"]["prefill_ms"] > 0
        for band in profiling.BANDS:
            pred = overlap["predicted"]["torch"][band]
            assert len(pred) == 3 and prof.choice(band).get("overlap_speedup", max(pred[1:])) == pytest.approx(max(pred[1:]), abs=1e-4)
