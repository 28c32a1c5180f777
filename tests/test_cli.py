"""`edgespec generate` end to end on tiny checkpoints, and its one-line errors.

The CLI runs in this process (`main([...])`, output through capsys); one test runs it as a user does, in a
subprocess, for the entry point and the streamed text."""

import contextlib
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


def run_main(capsys, *args):
    """The CLI in this process: exit code, stdout, stderr."""
    if args and args[0] == "generate":
        args = ("generate", *TORCH, *args[1:])
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


TORCH = ["--target-backend", "torch", "--draft-backend", "torch"]  # no ONNX export: keeps these tests fast


def generate(capsys, *args):
    """`edgespec generate ... --json` in this process: the JSON object and what went to stderr."""
    code, out, err = run_main(capsys, "generate", *args, "--json")
    assert code == 0, err
    return json.loads(out), err


def generate_json(capsys, *args):
    return generate(capsys, *args)[0]


def assert_drafted_throughout(result: dict, err: str) -> None:
    """No fallback to the target alone: no notice of a failed drafter (stderr, `notices` in the JSON), and every
    round but the last asked the drafter for tokens (after a failure the rest of the answer runs K = 0 rounds)."""
    assert "drafter failed" not in err, err
    assert not result.get("notices"), result["notices"]
    ks = result["metrics"]["k_per_round"]
    assert ks and 0 not in ks[:-1], ks  # the last round may have room for one token only: K = 0


def test_json_interface_and_greedy_equivalence(tiny_checkpoints, capsys):
    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    base = ["--target", t, "--prompt", "hello world", "--max-new-tokens", "24"]
    plain = generate_json(capsys, *base, "--no-spec")
    assert plain["metrics"]["num_drafts"] == 0 and len(plain["token_ids"]) <= 24
    # a perturbed copy of the target, the target drafting for itself, prompt lookup
    for draft in (d, t, "ngram"):
        spec, err = generate(capsys, *base, "--draft", draft, "--k", "3")
        assert spec["token_ids"] == plain["token_ids"]
        assert spec["text"] == plain["text"]
        assert_drafted_throughout(spec, err)
        m = spec["metrics"]
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                    "acceptance_rate", "tau", "tokens_per_s", "draft_ms", "verify_ms", "k_per_round"):
            assert key in m
        assert spec["stop_reason"] in ("eos", "length")
        if draft == t:  # greedy drafts of the target's own model are all accepted
            assert m["num_draft_tokens"] >= 3 * (len(m["k_per_round"]) - 3)
            assert m["num_accepted_tokens"] == m["num_draft_tokens"] and m["tau"] > 2
        elif draft == d:
            assert m["num_accepted_tokens"] > 0


def test_chat_template_and_sampling_options_reach_the_engine(tiny_checkpoints, capsys, monkeypatch):
    from edgespec.engine import SpeculativeEngine
    from edgespec.sampling import SamplingParams

    asked = []
    real_generate = SpeculativeEngine.generate

    def spy(self, prompt_ids, **kwargs):
        asked.append(kwargs["params"])
        return real_generate(self, prompt_ids, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "generate", spy)
    t = str(tiny_checkpoints["target"])
    base = ["--target", t, "--prompt", "hi", "--chat", "--max-new-tokens", "12",
            "--draft", str(tiny_checkpoints["draft"]), "--k", "3"]
    args = [*base, "--temperature", "0.8", "--top-p", "0.9", "--top-k", "40", "--seed", "7"]
    a = generate_json(capsys, *args)
    b = generate_json(capsys, *args)
    assert asked == [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7)] * 2
    assert a["token_ids"] == b["token_ids"]  # a seed (with a fixed K) makes sampling reproducible
    assert a["prompt_tokens"] > len("hi")  # the template added role markers
    # and sampling is on: other seeds draw other answers, where greedy decoding has only one
    answers = {tuple(generate_json(capsys, *base, "--temperature", "0.8", "--seed", str(seed))["token_ids"])
               for seed in range(4)}
    assert len(answers) > 1


def test_streaming_text_matches_json(tiny_checkpoints, capsys):
    t = str(tiny_checkpoints["target"])
    code, out, err = run_cli("generate", "--target", t, "--prompt", "abc abc", "--max-new-tokens", "16")
    assert code == 0, err
    js = generate_json(capsys, "--target", t, "--prompt", "abc abc", "--max-new-tokens", "16")
    assert out.rstrip("\n") == js["text"] and js["text"]
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


def test_error_vocab_mismatch(tiny_checkpoints, capsys):
    code, _, err = run_main(capsys, "generate", "--target", str(tiny_checkpoints["target"]),
                            "--draft", str(tiny_checkpoints["other_vocab"]), "--prompt", "x")
    one_line_error(code, err, "96", "128")


def test_error_missing_path(tmp_path, capsys):
    code, _, err = run_main(capsys, "generate", "--target", str(tmp_path / "nope"), "--prompt", "x")
    one_line_error(code, err, "does not exist")


def test_error_not_decoder_only(tmp_path, capsys):
    from transformers import T5Config

    T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2).save_pretrained(tmp_path)
    code, _, err = run_main(capsys, "generate", "--target", str(tmp_path), "--prompt", "x")
    one_line_error(code, err, "decoder-only")


def test_error_prompt_longer_than_context(tiny_checkpoints, capsys):
    code, _, err = run_main(capsys, "generate", "--target", str(tiny_checkpoints["target"]), "--prompt", "a" * 2100)
    one_line_error(code, err, "context")


@pytest.mark.parametrize("k", ["-1", "99"])
def test_error_bad_k(tiny_checkpoints, k, capsys):
    code, _, err = run_main(capsys, "generate", "--target", str(tiny_checkpoints["target"]), "--prompt", "x", "--k", k)
    one_line_error(code, err, "K=")


@pytest.mark.parametrize("p_min", ["1.5", "-0.2", "high"])
def test_error_bad_p_min(tiny_checkpoints, p_min, capsys):
    code, _, err = run_main(capsys, "generate", "--target", str(tiny_checkpoints["target"]), "--prompt", "x",
                            "--p-min", p_min)
    one_line_error(code, err, "--p-min", "from 0")


@pytest.mark.parametrize("argv,needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
    (["--max-new-tokens", "-5"], "--max-new-tokens -5 must be at least 1"),
    (["--temperature", "-1"], "--temperature -1 is out of range"),
    (["--temperature", "nan"], "--temperature nan is out of range"),
    (["--temperature", "inf"], "--temperature inf is out of range"),
    (["--top-k", "-1"], "--top-k -1 is negative"),
    (["--top-p", "0"], "--top-p 0 is outside (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5 is outside (0, 1]"),
    (["--seed", "-1"], "--seed -1 is out of range"),
    (["--seed", str(2**64 - 1)], "--seed 18446744073709551615 is out of range"),
    (["--threads", "0"], "--threads 0 must be at least 1"),
    (["--draft-threads", "-2"], "--draft-threads -2 must be at least 1"),
])
def test_bad_sampling_and_thread_options_are_one_line_errors_before_anything_loads(argv, needle, tmp_path, capsys):
    # the target does not exist: a check made only after loading would report that instead
    code, _, err = run_main(capsys, "generate", "--target", str(tmp_path / "nope"), "--prompt", "x", *argv)
    one_line_error(code, err, needle)


@pytest.mark.parametrize("argv,needle", [(["--repeats", "0"], "--repeats 0"),
                                         (["--per-category", "0"], "--per-category 0"),
                                         (["--max-new-tokens", "0"], "--max-new-tokens 0")])
def test_bench_counts_of_zero_are_errors_not_the_default(argv, needle, tmp_path, capsys):
    code, _, err = run_main(capsys, "bench", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), *argv)
    one_line_error(code, err, needle, "at least 1")
    assert not (tmp_path / "o").exists()


def test_chat_flag_without_a_chat_template_is_a_one_line_error(untemplated_target, capsys):
    code, out, err = run_main(capsys, "generate", "--target", str(untemplated_target), "--prompt", "hi", "--chat")
    one_line_error(code, err, "no chat template", "drop --chat")
    assert out == ""
    # without --chat the same model answers
    assert generate_json(capsys, "--target", str(untemplated_target), "--prompt", "hi", "--max-new-tokens", "4")["token_ids"]


def interrupt_after_first_step(monkeypatch):
    """Ctrl-C (KeyboardInterrupt) arrives while the second round runs."""
    from edgespec.engine import SpeculativeEngine

    real_generate = SpeculativeEngine.generate

    def generate(self, prompt_ids, **kwargs):
        steps = real_generate(self, prompt_ids, **kwargs)
        yield next(steps)
        steps.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(SpeculativeEngine, "generate", generate)


def test_ctrl_c_while_generating_keeps_the_text_so_far_and_exits_130(tiny_checkpoints, capsys, monkeypatch):
    t = str(tiny_checkpoints["target"])
    full = generate_json(capsys, "--target", t, "--prompt", "the cat", "--max-new-tokens", "20", "--k", "0")
    interrupt_after_first_step(monkeypatch)
    code, out, err = run_main(capsys, "generate", "--target", t, "--prompt", "the cat", "--max-new-tokens", "20",
                              "--k", "0")
    assert code == 130 and "Traceback" not in err
    assert out.rstrip("\n") == full["text"][:1] and "stop: cancelled" in err  # one round of K = 0: one token
    code, out, err = run_main(capsys, "generate", "--target", t, "--prompt", "the cat", "--max-new-tokens", "20",
                              "--k", "0", "--json")
    cut = json.loads(out)
    assert code == 130 and cut["stop_reason"] == "cancelled" and cut["token_ids"] == full["token_ids"][:1]


def test_ctrl_c_while_loading_exits_130_without_a_traceback(tmp_path, capsys, monkeypatch):
    from edgespec import runtime

    def build_runtime(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "build_runtime", build_runtime)
    try:
        code, out, err = run_main(capsys, "generate", "--target", str(tmp_path), "--prompt", "x", "--k", "0")
    except KeyboardInterrupt:  # let through, it would end this test run as well as print a traceback
        pytest.fail("Ctrl-C while loading escaped main()")
    assert code == 130 and out == "" and err.splitlines() == ["edgespec: interrupted"]


def test_p_min_keeps_the_answer_and_shortens_drafts(tiny_checkpoints, capsys):
    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    base = ["--target", t, "--draft", d, "--prompt", "hello world", "--max-new-tokens", "24", "--k", "4"]
    full = generate_json(capsys, *base)
    cut = generate_json(capsys, *base, "--p-min", "0.99")
    assert cut["token_ids"] == full["token_ids"]
    assert cut["metrics"]["num_draft_tokens"] < full["metrics"]["num_draft_tokens"]


def test_error_cuda_missing(tiny_checkpoints, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run_main(capsys, "generate", "--target", str(tiny_checkpoints["target"]), "--prompt", "x",
                            "--device", "cuda")
    one_line_error(code, err, "CUDA", "cpu")


def test_error_corrupt_weights(tiny_checkpoints, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["target"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    code, _, err = run_main(capsys, "generate", "--target", str(broken), "--prompt", "x")
    one_line_error(code, err, "corrupt")


def test_error_profile_with_exact(tiny_checkpoints, capsys):
    assert main(["profile", "--target", str(tiny_checkpoints["target"]), "--exact", "--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop --exact" in err[0] and err[0].startswith("edgespec: error:")


def measured_beside(monkeypatch):
    """Spy on `edgespec.profiling`: {"alone": [...], "beside": [...]}, the measurements (function names) taken
    alone and while `running_beside` had the other model working."""
    from edgespec import profiling

    seen, active = {"alone": [], "beside": []}, []
    real_beside = profiling.running_beside

    @contextlib.contextmanager
    def running_beside(work):
        with real_beside(work):
            active.append(work)
            try:
                yield
            finally:
                active.pop()

    def spy(name):
        real = getattr(profiling, name)

        def measure(*args, **kwargs):
            seen["beside" if active else "alone"].append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(profiling, name, measure)

    monkeypatch.setattr(profiling, "running_beside", running_beside)
    for name in ("measure_verify", "measure_propose"):
        spy(name)
    return seen


def profile_tiny(tiny_checkpoints, out, *extra):
    assert main(["profile", "--target", str(tiny_checkpoints["target"]), "--target-backend", "torch",
                 "--draft", str(tiny_checkpoints["draft"]), "--draft-backend", "torch",
                 "--quick", "--out", str(out), *extra]) == 0
    from edgespec import profiling

    return profiling.read_profile(out)


def test_profile_end_to_end_on_tiny_models_measures_the_drafters_prefill(tiny_checkpoints, tmp_path, monkeypatch):
    from edgespec import profiling, runtime

    # The split a machine with cores to spare runs --overlap with, whatever this one has: nothing below depends
    # on the core count.
    monkeypatch.setattr(runtime, "overlap_threads", lambda device: (1, 1))
    seen = measured_beside(monkeypatch)
    prof = profile_tiny(tiny_checkpoints, tmp_path / "tiny.toml", "--k-max", "2")
    assert prof.data["settings"]["typical_prompt_tokens"] > 100  # the calibration prompts, one token a char
    # Taking in a 256-token context costs a model drafter real time; the n-gram lookup nothing to speak of.
    assert prof.catch_up_ms("torch") > prof.catch_up_ms("ngram") >= 0
    for band in profiling.BANDS:
        assert {"drafter", "k", "speedup", "request_speedup"} <= set(prof.choice(band))
    # The models are measured again with the cores split as --overlap runs them.
    overlap = prof.data["overlap"]
    assert (overlap["threads"], overlap["draft_threads"]) == (1, 1)
    assert set(overlap["drafters"]) == {"torch"}  # n-gram has nothing to overlap
    assert len(overlap["verify"]) == 4 and all(t > 0 for t in overlap["verify"][1:])
    # the split latencies were taken with the other model working beside, the others alone
    assert sorted(seen["beside"]) == ["measure_propose", "measure_verify"]
    assert {"measure_propose", "measure_verify"} <= set(seen["alone"])
    # the prefills of a typical prompt on every core and split (the draft model taking it in beside the
    # target) are both measured
    assert prof.data["latency"]["prefill_tokens"] == prof.data["settings"]["typical_prompt_tokens"]
    assert prof.data["latency"]["prefill_ms"] > 0 and overlap["drafters"]["torch"]["prefill_ms"] > 0
    for band in profiling.BANDS:
        pred = overlap["predicted"]["torch"][band]
        assert len(pred) == 3 and prof.choice(band).get("overlap_speedup", max(pred[1:])) == pytest.approx(max(pred[1:]), abs=1e-4)


def test_profile_on_one_core_measures_no_split(tiny_checkpoints, tmp_path, monkeypatch, capsys):
    from edgespec import profiling, runtime

    monkeypatch.setattr(runtime, "overlap_threads", lambda device: None)  # one usable core: nothing to split
    seen = measured_beside(monkeypatch)
    prof = profile_tiny(tiny_checkpoints, tmp_path / "one-core.toml", "--k-max", "1")
    assert "overlap" not in prof.data and "prefill_ms" not in prof.data["latency"]
    assert seen["beside"] == [] and seen["alone"]
    assert "one usable core: overlapped drafting is not measured" in capsys.readouterr().err
    assert all("overlap" not in prof.choice(band) for band in profiling.BANDS)


@pytest.mark.parametrize("env, argv, what", [
    ("EDGESPEC_DATA", ("chat", "--list"), "data"),
    ("EDGESPEC_CACHE", ("prepare",), "cache"),
])
@pytest.mark.parametrize("blocked", ["file", "under_a_file"])
def test_a_data_or_cache_folder_that_cannot_be_made_is_a_one_line_error(env, argv, what, blocked, tmp_path, capsys,
                                                                        monkeypatch):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a folder")
    monkeypatch.setenv(env, str(in_the_way if blocked == "file" else in_the_way / "below"))
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("edgespec: error:")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n")
    assert f"edgespec's {what} folder" in errors[0] and f"point {env} at a folder" in errors[0]
    assert ("a file is in its way" in errors[0]) == (blocked == "file")
    assert in_the_way.read_text() == "not a folder"  # nothing of the user's overwritten
