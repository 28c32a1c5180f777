"""`edgespec bench`: the report maths on synthetic records, a quick run on tiny models, and its errors."""

import json

import pytest

from edgespec import bench
from edgespec.bench import TARGET_ONLY, RunRecord, first_difference, median, summarise
from edgespec.cli import main
from edgespec.errors import EdgespecError


def rec(config, pid, cat, rep, n_tokens, wall, metrics=None, ids=None, prefill=0.0):
    return RunRecord(config, pid, cat, rep, ids if ids is not None else list(range(n_tokens)), wall, prefill, metrics)


def m(drafted, accepted, forwards, emitted, per_d, per_a, draft_ms=10.0, verify_ms=30.0):
    return {"num_draft_tokens": drafted, "num_accepted_tokens": accepted, "num_target_forwards": forwards,
            "num_emitted_tokens": emitted, "drafted_per_position": per_d, "accepted_per_position": per_a,
            "draft_ms": draft_ms, "verify_ms": verify_ms}


def test_median_and_first_difference():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 2, 3]) == 2.5
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    with pytest.raises(ValueError):
        median([])


def test_summary_speedup_tau_acceptance():
    spec_m = m(drafted=8, accepted=6, forwards=4, emitted=10, per_d=[4, 4], per_a=[4, 2])
    records = [
        # target-only: 10 tokens in 1.0 s (median of 0.9, 1.0, 5.0: the outlier is ignored)
        rec(TARGET_ONLY, "p1", "code", 0, 10, 0.9), rec(TARGET_ONLY, "p1", "code", 1, 10, 1.0),
        rec(TARGET_ONLY, "p1", "code", 2, 10, 5.0),
        rec("int4@2", "p1", "code", 0, 10, 0.5, spec_m), rec("int4@2", "p1", "code", 1, 10, 0.4, spec_m),
        rec("int4@2", "p1", "code", 2, 10, 0.6, spec_m),
    ]
    s = summarise(records, greedy=True)
    row = s["configs"]["int4@2"]["code"]
    assert row["tokens_per_s"] == pytest.approx(20.0)
    assert row["speedup"] == pytest.approx(2.0)
    assert row["tau"] == pytest.approx(10 / 4)
    assert row["acceptance_rate"] == pytest.approx(6 / 8)
    assert row["acceptance_per_position"] == [1.0, 0.5]
    assert row["draft_share"] == pytest.approx(0.25)
    assert s["configs"][TARGET_ONLY]["overall"]["speedup"] == pytest.approx(1.0)
    assert s["mismatches"] == []


def test_summary_totals_weigh_long_answers_and_flag_mismatch():
    records = [
        rec(TARGET_ONLY, "a", "qa", 0, 10, 1.0, ids=list(range(10))), rec(TARGET_ONLY, "b", "rag", 0, 30, 1.0),
        rec("ngram@4", "a", "qa", 0, 10, 0.5, ids=[0, 1, 9, 3, 4, 5, 6, 7, 8, 9]), rec("ngram@4", "b", "rag", 0, 30, 3.0),
    ]
    s = summarise(records, greedy=True)
    overall = s["configs"]["ngram@4"]["overall"]
    # total tokens over total time: 40 tokens / 3.5 s vs target-only 40 / 2.0
    assert overall["tokens_per_s"] == pytest.approx(40 / 3.5)
    assert overall["speedup"] == pytest.approx((40 / 3.5) / 20)
    assert s["mismatches"] == [{"config": "ngram@4", "prompt_id": "a", "first_difference": 2}]
    assert s["configs"]["ngram@4"]["qa"]["mismatches"] == 1 and s["configs"]["ngram@4"]["rag"]["mismatches"] == 0
    assert summarise(records, greedy=False)["mismatches"] == []  # sampling outputs are not compared


def test_auto_against_the_fixed_k_sweep():
    # 10 tokens per prompt; wall times give tokens/s: target-only 10, ngram@2 20 / 5, ngram@4 12.5 / 4, auto 19.2 / 9
    walls = {TARGET_ONLY: (1.0, 1.0), "ngram@2": (0.5, 2.0), "ngram@4": (0.8, 2.5), "ngram@auto": (10 / 19.2, 10 / 9),
             "ngram@2+overlap": (0.1, 0.1)}
    records = [rec(c, pid, cat, 0, 10, w[i]) for c, w in walls.items() for i, (pid, cat) in enumerate([("a", "qa"), ("b", "rag")])]
    sweep = bench.auto_vs_fixed(summarise(records, greedy=False))
    assert list(sweep) == ["ngram@auto"]  # the overlap run is not part of the plain auto's sweep
    qa, rag = sweep["ngram@auto"]["qa"], sweep["ngram@auto"]["rag"]
    assert qa["best_k"] == 2 and qa["best_speedup"] == pytest.approx(2.0)
    assert qa["auto_over_best"] == pytest.approx(0.96) and qa["within_best"] and qa["not_below_k0"]
    assert rag["best_k"] == 0 and rag["auto_speedup"] == pytest.approx(0.9)
    assert not rag["within_best"] and not rag["not_below_k0"]
    result = bench.BenchResult(command="x", machine={}, settings={}, records=records,
                               summary=summarise(records, greedy=False), load_before=(0, 0, 0), load_after=(0, 0, 0),
                               peak_rss_mb=0, wall_s=1, notes=[])
    assert "ngram@auto: 1 of 2 categories meet both targets; missed: rag." in bench.markdown(result)


def test_auto_against_fixed_k_compares_decode_rates():
    # a slow target prefill (noise: the same work at every K) must not make auto look better than it decodes
    met = m(drafted=4, accepted=2, forwards=4, emitted=10, per_d=[4], per_a=[2])
    records = [rec(TARGET_ONLY, "a", "qa", 0, 10, 2.0, met, prefill=1.0), rec("ngram@2", "a", "qa", 0, 10, 1.2, met, prefill=0.2),
               rec("ngram@auto", "a", "qa", 0, 10, 1.05, met, prefill=0.0)]
    qa = bench.auto_vs_fixed(summarise(records, greedy=False))["ngram@auto"]["qa"]
    assert qa["auto_over_best"] == pytest.approx(10 / 1.05 / 10)  # decode 9.52 tok/s vs 10 (whole request: 9.52 vs 8.33)
    assert qa["within_best"] and not qa["not_below_k0"]


def test_the_cost_model_is_reported_beside_the_measured_speed_up():
    # int4 at K=2, position 0 accepted in 4 of 5 rounds, both positions in 2 of 5: survival 0.8, 0.4
    def met(catch_up_ms=100.0):
        d = m(drafted=10, accepted=6, forwards=5, emitted=10, per_d=[5, 5], per_a=[4, 2])
        d["asked_per_position"] = [5, 5]
        if catch_up_ms is not None:
            d["catch_up_ms"] = catch_up_ms
        return d

    lat = {"profile": "p.toml", "drafters": {"int4": {"draft_s": [0, 0.01, 0.02, 0.03], "verify_s": [0, 0.05, 0.06, 0.07, 0.08]}}}
    records = [rec(TARGET_ONLY, "a", "qa", 0, 10, 1.0, m(0, 0, 10, 10, [], [])),  # plain decoding: 10 tok/s
               # decode 0.7 s of which 0.1 s the draft model's catch-up: steady 10 / 0.6 s
               rec("int4@2", "a", "qa", 0, 10, 0.8, met(), prefill=0.1),
               rec("int4@2+overlap", "a", "qa", 0, 10, 0.1 + 0.1 + 10 / 13, met(), prefill=0.1),
               rec("int4@2+p0.75", "a", "qa", 0, 10, 0.8, met(), prefill=0.1),  # drafts may stop early: priced too
               rec("int4@auto", "a", "qa", 0, 10, 0.8, met(), prefill=0.1),  # auto: no single K to price
               rec("ngram@2", "a", "qa", 0, 10, 0.8, met(), prefill=0.1)]  # not in the profile
    s = summarise(records, greedy=False)
    assert s["configs"]["int4@2"]["qa"]["survival"] == pytest.approx([0.8, 0.4])
    assert s["configs"]["int4@2"]["qa"]["reach"] == pytest.approx([1.0, 1.0])
    pred = bench.predictions(s, lat)
    assert sorted(pred) == ["int4@2", "int4@2+overlap", "int4@2+p0.75"]
    assert pred["int4@2+p0.75"]["overall"] == pred["int4@2"]["overall"]  # the same rounds, priced the same
    seq = pred["int4@2"]["overall"]
    # E(2) = 1 + 0.8 + 0.4 = 2.2 tokens per round; sequential: 2 drafts 0.02 s + verify of 3 tokens 0.07 s
    assert seq["predicted"] == pytest.approx(2.2 * 0.05 / 0.09)
    assert seq["measured"] == pytest.approx((10 / 0.6) / 10)
    assert not seq["within"]  # 1.67x measured against 1.22x predicted
    ovl = pred["int4@2+overlap"]["overall"]
    # overlapped: max(3 drafts ahead, verify) = 0.07 s, plus the 2 drafts again unless all 2 and the guess pass
    # (P = 0.4 * 0.4 / 0.8 = 0.2, the last conditional rate carried one position on)
    assert ovl["predicted"] == pytest.approx(2.2 * 0.05 / (0.07 + 0.8 * 0.02))
    assert ovl["measured"] == pytest.approx(1.3) and ovl["within"]
    result = bench.BenchResult(command="x", machine={}, settings={}, records=records, summary=s, load_before=(0, 0, 0),
                               load_after=(0, 0, 0), peak_rss_mb=0, wall_s=1, notes=[], latencies=lat)
    md = bench.markdown(result)
    assert "## Cost model against measured" in md and "Overall within 15%: 1 of 3 configurations." in md
    # records from before the catch-up was kept: no steady rate, so nothing is predicted rather than a wrong figure
    old = [rec(TARGET_ONLY, "a", "qa", 0, 10, 1.0, m(0, 0, 10, 10, [], [])),
           rec("int4@2", "a", "qa", 0, 10, 0.8, met(catch_up_ms=None), prefill=0.1)]
    assert bench.predictions(summarise(old, greedy=False), lat) == {}


def written_sample(tmp_path):
    """A small sampled run (target-only and int8@2 on one prompt) written as a report: its paths."""
    met = m(drafted=10, accepted=6, forwards=5, emitted=10, per_d=[5, 5], per_a=[4, 2])
    met.update(asked_per_position=[5, 5], catch_up_ms=0.0)
    records = [rec(TARGET_ONLY, "a", "qa", 0, 10, 1.0, m(0, 0, 10, 10, [], [])), rec("int8@2", "a", "qa", 0, 10, 0.6, met)]
    result = bench.BenchResult(command="x", machine={}, settings={}, records=records, summary=summarise(records, greedy=False),
                               load_before=(0, 0, 0), load_after=(0, 0, 0), peak_rss_mb=0, wall_s=1, notes=[])
    return bench.write_outputs(result, tmp_path, "run")


def test_a_report_is_rerendered_from_its_json_with_a_profile_s_predictions(tmp_path, capsys):
    from test_profiling import sample_profile

    from edgespec import profiling

    paths = written_sample(tmp_path)
    assert "Cost model" not in paths["md"].read_text()  # the run had no profile
    profile = profiling.write_profile(sample_profile(), tmp_path / "p.toml")
    assert main(["bench", "--report", str(paths["json"]), "--profile", str(profile)]) == 0
    md = paths["md"].read_text()
    assert "## Cost model against measured" in md and "| int8@2 |" in md
    assert json.loads(paths["json"].read_text())["latencies"]["drafters"]["int8"]["verify_s"][1] == pytest.approx(0.020)
    capsys.readouterr()
    assert main(["bench", "--report", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read the bench result" in err[0] and "missing.json" in err[0]


def test_a_run_on_the_profiles_overlap_split_is_predicted_from_the_split_latencies(tmp_path):
    from test_profiling import sample_profile, with_split

    from edgespec import profiling

    prof = profiling.read_profile(profiling.write_profile(
        with_split(sample_profile(), verify=(0, 32, 35, 38, 42, 45), draft_per_token=3.9), tmp_path / "p.toml"))
    split = bench.profile_latencies(prof, ["int8", "ngram"], (1, 1))
    assert split["split"] == "the target 1 thread(s), the draft 1 thread(s)"
    assert split["drafters"]["int8"]["verify_s"][1] == pytest.approx(0.032)
    assert split["drafters"]["int8"]["draft_s"][1] == pytest.approx(0.0039)
    assert split["drafters"]["ngram"]["verify_s"][1] == pytest.approx(0.032)  # the lookup's own cost: unchanged
    for threads in ((None, None), (2, 2), (1, None)):  # every core, or another split: the sequential latencies
        full = bench.profile_latencies(prof, ["int8"], threads)
        assert "split" not in full and full["drafters"]["int8"]["verify_s"][1] == pytest.approx(0.020)
    # A re-render knows the run's threads from its settings.
    met = m(drafted=10, accepted=6, forwards=5, emitted=10, per_d=[5, 5], per_a=[4, 2])
    met.update(asked_per_position=[5, 5], catch_up_ms=0.0)
    records = [rec(TARGET_ONLY, "a", "qa", 0, 10, 1.0, m(0, 0, 10, 10, [], [])), rec("int8@2", "a", "qa", 0, 10, 0.6, met)]
    result = bench.BenchResult(command="x", machine={}, settings={"threads": {"target": 1, "draft": 1}}, records=records,
                               summary=summarise(records, greedy=False), load_before=(0, 0, 0), load_after=(0, 0, 0),
                               peak_rss_mb=0, wall_s=1, notes=[])
    paths = bench.write_outputs(result, tmp_path, "run")
    assert main(["bench", "--report", str(paths["json"]), "--profile", str(prof.path)]) == 0
    assert "measured with the cores split as this run split them" in paths["md"].read_text()
    assert json.loads(paths["json"].read_text())["latencies"]["drafters"]["int8"]["verify_s"][1] == pytest.approx(0.032)


def test_prompt_set_filters():
    assert len(bench.load_prompts(quick=True)) == len(bench.CATEGORIES)
    assert {p["category"] for p in bench.load_prompts(["code", "rag"])} == {"code", "rag"}
    two = bench.load_prompts(["code", "rag"], per_category=2)
    assert [p["id"] for p in two] == ["rag-01", "rag-02", "code-01", "code-02"]
    assert len(bench.load_prompts(per_category=100)) == len(bench.load_prompts())
    with pytest.raises(EdgespecError, match="--per-category must be at least 1"):
        bench.load_prompts(per_category=0)


@pytest.mark.parametrize("bad,needle", [(["poetry"], "unknown bench category")])
def test_unknown_category(bad, needle):
    with pytest.raises(EdgespecError, match=needle):
        bench.load_prompts(bad)


@pytest.mark.parametrize("text", ["0,99", "-1", "two"])
def test_bad_k_list(text):
    with pytest.raises(EdgespecError):
        bench.parse_ks(text)


def quick_args(ckpts, out):
    return ["bench", "--target", str(ckpts["target"]), "--draft", str(ckpts["draft"]), "--target-backend", "torch",
            "--draft-backend", "torch", "--quick", "--categories", "code,rag,qa", "--max-new-tokens", "12",
            "--k", "2,auto", "--out", str(out)]


def test_quick_run_writes_reports(tiny_checkpoints, tmp_path, capsys):
    assert main(quick_args(tiny_checkpoints, tmp_path)) == 0
    out = capsys.readouterr().out
    assert "Greedy check: every output equals target-only's" in out
    files = sorted(p.name for p in tmp_path.iterdir())
    assert [f.rsplit(".", 1)[1] for f in files] == ["json", "md", "png"]
    data = json.loads((tmp_path / files[0]).read_text())
    configs = set(data["summary"]["configs"])
    assert {TARGET_ONLY, "torch@2", "torch@auto", "ngram@2", "hf-assisted", "hf-assisted@4", "hf-prompt-lookup@4"} <= configs
    assert data["summary"]["mismatches"] == []
    # the draft model takes in the prompt at its first drafted round: kept apart, so steady rounds can be priced
    assert any(r["metrics"]["catch_up_ms"] > 0 for r in data["records"] if r["config"] == "torch@2")
    assert data["summary"]["configs"]["torch@2"]["overall"]["steady_speedup"] is not None
    assert (tmp_path / files[2]).read_bytes()[:4] == b"\x89PNG"


def test_quick_run_flags_injected_greedy_mismatch(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    import edgespec.engine as engine_mod
    from edgespec.verify import Verdict

    # A broken rule that accepts every draft: speculative outputs now differ from target-only.
    monkeypatch.setattr(engine_mod, "accept_greedy", lambda draft, choice: Verdict(len(draft), choice[-1]))
    assert main(quick_args(tiny_checkpoints, tmp_path) + ["--no-anchors"]) == 1
    out = capsys.readouterr().out
    assert "GREEDY MISMATCHES" in out and "first difference at generated token" in out


def test_per_category_runs_the_first_n_prompts_of_each_category(tiny_checkpoints, tmp_path):
    args = ["bench", "--target", str(tiny_checkpoints["target"]), "--draft", "ngram", "--target-backend", "torch",
            "--categories", "code,rag", "--per-category", "2", "--max-new-tokens", "6", "--k", "2", "--repeats", "1",
            "--no-anchors", "--out", str(tmp_path)]
    assert main(args) == 0
    [json_path] = tmp_path.glob("*.json")
    assert json_path.stem.endswith("-n2")  # does not overwrite the full run's report
    data = json.loads(json_path.read_text())
    assert sorted({r["prompt_id"] for r in data["records"]}) == ["code-01", "code-02", "rag-01", "rag-02"]


def test_unknown_drafter_is_one_line_error(tiny_checkpoints, tmp_path, capsys):
    assert main(quick_args(tiny_checkpoints, tmp_path) + ["--drafters", "magic"]) == 2
    err = capsys.readouterr().err
    assert "unknown drafter 'magic'" in err


def test_with_an_exact_reference_the_greedy_check_compares_against_it():
    from edgespec.bench import TARGET_ONLY_EXACT

    records = [
        rec(TARGET_ONLY, "a", "qa", 0, 4, 1.0, ids=[1, 2, 3, 4]),  # the one-row kernels round a tie the other way
        rec(TARGET_ONLY_EXACT, "a", "qa", 0, 4, 1.1, ids=[1, 2, 7, 8]),
        rec("int4@3", "a", "qa", 0, 4, 0.5, ids=[1, 2, 7, 8]),
        rec("ngram@3", "a", "qa", 0, 4, 0.6, ids=[1, 2, 7, 9]),
    ]
    s = summarise(records, greedy=True)
    assert s["reference"] == TARGET_ONLY_EXACT
    assert s["mismatches"] == [{"config": "ngram@3", "prompt_id": "a", "first_difference": 3}]
    # the speed baseline stays the plain target-only run
    assert s["configs"]["int4@3"]["overall"]["speedup"] == pytest.approx(2.0)
    assert s["configs"][TARGET_ONLY_EXACT]["overall"]["speedup"] == pytest.approx(1 / 1.1)


def test_with_repeats_the_sweep_shows_each_run_and_the_run_to_run_spread():
    """Two runs of the same sweep: auto over the best fixed K of each run on its own, and per category the
    median over configurations of how far one run's rate is from the other's."""
    # 10 tokens a prompt; walls per (config, repeat): tokens/s 10 / 8, 20 / 16.67, 19.05 / 16.67
    walls = {TARGET_ONLY: (1.0, 1.25), "ngram@2": (0.5, 0.6), "ngram@auto": (0.525, 0.6)}
    records = [rec(c, "a", "qa", rep, 10, w[rep]) for c, w in walls.items() for rep in (0, 1)]
    runs = bench.per_repeat(records, greedy=False)
    assert [run["configs"]["ngram@2"]["qa"]["tokens_per_s"] for run in runs] == pytest.approx([20.0, 10 / 0.6])
    each = [bench.auto_vs_fixed(run)["ngram@auto"]["qa"]["auto_over_best"] for run in runs]
    assert each == pytest.approx([0.5 / 0.525, 1.0])
    # spreads: target-only 1.25 - 1 = 0.25, ngram@2 0.2, auto 0.6 / 0.525 - 1 = 0.143: median 0.2
    assert bench.repeat_spread(runs)["qa"] == pytest.approx(0.2)
    assert bench.per_repeat([r for r in records if r.repeat == 0], greedy=False) == []
    result = bench.BenchResult(command="x", machine={}, settings={}, records=records,
                               summary=summarise(records, greedy=False), load_before=(0, 0, 0), load_after=(0, 0, 0),
                               peak_rss_mb=0, wall_s=1, notes=[])
    md = bench.markdown(result)
    assert "| auto / best fixed, each run | 0.95, 1.00 | 0.95, 1.00 |" in md
    assert "| run-to-run spread | 20% | 20% |" in md


def test_run_bench_for_runs_and_writes_a_report_from_python(tiny_checkpoints, tmp_path):
    """The bench procedure without the command line (as a server or the Python API calls it): explicit
    parameters, the result and the paths written back, the caller's spec left as given."""
    from edgespec.runtime import RuntimeSpec
    from edgespec.sampling import SamplingParams

    spec = RuntimeSpec(target=str(tiny_checkpoints["target"]), target_backend="torch")
    result, paths = bench.run_bench_for(spec, ks=[0, 2], params=SamplingParams(), categories=["code"], per_category=1,
                                        drafters=["ngram"], repeats=1, max_new_tokens=6, anchors=False,
                                        out_dir=tmp_path, command="from python", progress=False)
    assert spec.draft is None  # the run loaded no draft model for the n-gram drafter, on a copy of the spec
    assert set(result.summary["configs"]) == {TARGET_ONLY, "ngram@2"}
    assert result.command == "from python" and result.settings["max_new_tokens"] == 6
    assert [r.prompt_id for r in result.records if r.config == TARGET_ONLY] == ["code-01"]
    assert result.summary["mismatches"] == []
    assert {k: p.name for k, p in paths.items()} == {k: f"custom-torch-t0-n1.{k}" for k in ("json", "md", "png")}
    assert paths["md"].read_text() == bench.markdown(result)
    with pytest.raises(EdgespecError, match="unknown drafter 'magic'"):
        bench.run_bench_for(spec, ks=[2], params=SamplingParams(), drafters=["magic"], out_dir=tmp_path)


def test_rerender_from_python_reproduces_the_report_and_takes_a_profile(tmp_path):
    from test_profiling import sample_profile

    from edgespec import profiling

    written = written_sample(tmp_path)
    md, js = written["md"].read_text(), written["json"].read_text()
    again, paths = bench.rerender(written["json"])
    assert paths == written and paths["md"].read_text() == md and paths["json"].read_text() == js
    assert again.latencies == {} and bench.markdown(again) == md
    profile = profiling.write_profile(sample_profile(), tmp_path / "p.toml")
    with_profile, _ = bench.rerender(str(written["json"]), profile)
    assert set(with_profile.latencies["drafters"]) == {"int8"}
    assert "## Cost model against measured" in written["md"].read_text()
