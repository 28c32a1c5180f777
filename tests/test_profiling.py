"""Profiles: TOML round trip, the choice of K and drafter, matching, and bad files falling back to calibration."""

import pytest

from edgespec import profiling
from edgespec.errors import EdgespecError
from edgespec.policy import AdaptiveK

HW = {"cpu_model": "Test CPU", "cores_logical": 2, "cores_usable": 2, "cuda_devices": []}


def sample_profile(verify=(0, 20, 22, 24, 26, 28), draft_per_token=3.0):
    data = {
        "schema": profiling.SCHEMA,
        "created": "2026-12-03T00:00:00",
        "command": "edgespec profile --pair demo",
        "machine": {"key": profiling.machine_key(HW), "cpu_model": "Test CPU", "cores_logical": 2, "gpu": "none"},
        "pair": {"name": "demo", "target": "t", "target_backend": "onnx", "draft": "d"},
        "latency": {"unit": "ms", "contexts": [128, 512],
                    "verify": {"128": list(verify), "512": list(verify)}, "verify_spread": {"128": [0.0] * 6, "512": [0.0] * 6}},
        "drafters": {
            "int8": {"description": "d", "propose": {"128": [k * draft_per_token for k in range(5)],
                                                      "512": [k * draft_per_token for k in range(5)]},
                     "acceptance": {"greedy": [0.9, 0.8, 0.7, 0.6], "sampling": [0.1, 0.01, 0.0, 0.0]}},
            "ngram": {"description": "n", "propose": {"128": [0.0] * 5, "512": [0.0] * 5},
                      "acceptance": {"greedy": [0.2, 0.1, 0.05, 0.0], "sampling": [0.3, 0.2, 0.1, 0.05]},
                      "reach": {"greedy": [1.0] * 4, "sampling": [1.0] * 4}},
        },
    }
    profiling.predict(data, 4)
    return data


def test_predict_chooses_drafter_and_k_per_band():
    data = sample_profile()
    greedy = data["choice"]["greedy"]
    # K=4: E = 1 + .9 + .8 + .7 + .6 = 4.0 tokens for 4 * 3 + 28 = 40 ms, vs 20 ms a token plain: 2.0x
    # No prefill measured (no typical prompt): the whole answer runs as fast as its rounds.
    assert greedy == {"drafter": "int8", "k": 4, "speedup": pytest.approx(2.0), "request_speedup": pytest.approx(2.0)}
    # At T=0.7 the model draft is rarely accepted; cheap n-gram drafting with 30% acceptance still pays.
    assert data["choice"]["sampling"]["drafter"] == "ngram"


def test_reach_discounts_positions_a_drafter_seldom_proposes():
    data = sample_profile()
    before = data["drafters"]["ngram"]["predicted"]["greedy"]
    data["drafters"]["ngram"]["reach"]["greedy"] = [0.3, 0.2, 0.1, 0.05]  # proposals are mostly short
    profiling.predict(data, 4)
    after = data["drafters"]["ngram"]["predicted"]["greedy"]
    assert all(a > b for a, b in zip(after[1:], before[1:]))  # same acceptance, paid only where proposed
    assert profiling.Profile(data).reach("ngram", "greedy") == [0.3, 0.2, 0.1, 0.05]
    assert profiling.Profile(data).reach("int8", "greedy") is None  # not measured: always reaches


def test_nothing_pays_means_k_zero():
    data = sample_profile(verify=(0, 20, 40, 60, 80, 100), draft_per_token=25.0)
    for band in profiling.BANDS:
        assert data["choice"][band] == {"drafter": "none", "k": 0, "speedup": 1.0, "request_speedup": 1.0}


def test_toml_round_trip(tmp_path):
    data = sample_profile()
    path = profiling.write_profile(data, tmp_path / "p.toml")
    prof = profiling.read_profile(path)
    assert prof.data == data
    lat = prof.latencies("int8")
    assert lat.verify[1] == pytest.approx(0.020) and lat.draft[2] == pytest.approx(0.006)


def test_find_profile_matches_machine_pair_and_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "profile_dirs", lambda: [tmp_path])
    profiling.write_profile(sample_profile(), tmp_path / "demo.toml")
    assert profiling.find_profile("demo", "onnx", HW) is not None
    assert profiling.find_profile("demo", "torch", HW) is None
    assert profiling.find_profile("other", "onnx", HW) is None
    assert profiling.find_profile("demo", "onnx", {**HW, "cpu_model": "Another CPU"}) is None


def test_a_torch_profile_matches_only_the_dtype_it_was_measured_with(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "profile_dirs", lambda: [tmp_path])
    data = sample_profile()
    data["pair"] = {**data["pair"], "target_backend": "torch", "target": "Demo · torch cpu float32"}
    profiling.write_profile(data, tmp_path / "demo-torch.toml")
    assert profiling.find_profile("demo", "torch", HW, target_detail="torch cpu float32") is not None
    assert profiling.find_profile("demo", "torch", HW, target_detail="torch cpu bfloat16") is None


@pytest.mark.parametrize("content", ["not = [valid toml", "schema = 1\n", "schema = 99\n"])
def test_corrupt_profile_is_one_line_error(tmp_path, content):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(EdgespecError) as err:
        profiling.read_profile(path)
    assert "\n" not in str(err.value) and "edgespec profile" in str(err.value)


def test_no_profile_is_one_warning_saying_what_profiling_takes(tmp_path, monkeypatch, capsys):
    from edgespec.runtime import PROFILE_MINUTES, RuntimeSpec, select_profile

    monkeypatch.setattr(profiling, "profile_dirs", lambda: [tmp_path])
    assert select_profile(RuntimeSpec(pair="qwen2.5-coder-1.5b"), None, 0.0) is None
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and "no profile for this machine" in warnings[0]
    assert "`edgespec profile --pair qwen2.5-coder-1.5b`" in warnings[0]
    assert f"about {PROFILE_MINUTES['qwen2.5-coder-1.5b']} minutes" in warnings[0]
    select_profile(RuntimeSpec(target=str(tmp_path)), None, 0.0)
    custom = capsys.readouterr().err.strip().splitlines()
    assert len(custom) == 1 and "several minutes" in custom[0] and "--profile PATH" in custom[0]


def test_corrupt_profile_warns_and_falls_back_to_calibration(tmp_path, capsys):
    from edgespec.runtime import RuntimeSpec, make_policy, select_profile

    bad = tmp_path / "bad.toml"
    bad.write_text("garbage = ")
    spec = RuntimeSpec(pair="smollm2-135m")
    profile = select_profile(spec, str(bad), 0.0)
    err = capsys.readouterr().err
    assert profile is None
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "calibrating K online" in warnings[0]
    policy = make_policy("auto", profile, "int8", 0.0)
    assert isinstance(policy, AdaptiveK)
    assert [policy.next_k() for _ in range(3)] == [0, 2, 4]  # calibration rounds


def test_policy_from_profile_is_seeded_and_skips_calibration():
    prof = profiling.Profile(sample_profile())
    policy = profiling.policy_from_profile(prof, "int8", 0.0, k_max=4)
    assert policy.verify[1] == pytest.approx(0.020)
    assert policy.conditional_acceptance()[0] == pytest.approx(0.9)
    assert policy.next_k() >= 3


def test_terminal_plot_and_table():
    data = sample_profile()
    assert "greedy (T=0.0): choose int8" in profiling.table(data)
    plot = profiling.terminal_plot(data["drafters"]["int8"]["predicted"]["greedy"])
    assert plot.splitlines()[0].startswith("K=0")


def test_the_planned_torch_detail_names_device_and_dtype():
    from edgespec.runtime import RuntimeSpec, planned_torch_detail

    assert planned_torch_detail(RuntimeSpec(pair="smollm2-135m", target_backend="torch", dtype="bfloat16")) == "torch cpu bfloat16"
    assert planned_torch_detail(RuntimeSpec(pair="smollm2-135m", target_backend="torch")) == "torch cpu float32"
    assert planned_torch_detail(RuntimeSpec(pair="smollm2-135m", target_backend="onnx")) is None


def test_default_path_keeps_torch_dtypes_apart():
    data = sample_profile()
    data["pair"] = {**data["pair"], "target_backend": "torch", "target": "Demo · torch cpu bfloat16"}
    assert profiling.default_path(data).name == "test-cpu-2c-isa-unknown-demo-torch-bfloat16.toml"
    data["pair"]["target_backend"], data["pair"]["target"] = "onnx", "Demo · onnxruntime cpu int4"
    assert profiling.default_path(data).name == "test-cpu-2c-isa-unknown-demo-onnx.toml"


def test_profiles_are_written_to_the_user_data_dir_and_read_before_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_DATA", str(tmp_path / "data"))
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(profiling, "PROFILES_DIR", shipped)
    data = sample_profile()
    assert profiling.default_path(data).parent == tmp_path / "data" / "profiles"
    assert profiling.profile_dirs() == [tmp_path / "data" / "profiles", shipped]
    profiling.write_profile(data, shipped / "demo.toml")
    assert profiling.find_profile("demo", "onnx", HW).path == shipped / "demo.toml"
    mine = profiling.write_profile(data, profiling.default_path(data))
    assert profiling.find_profile("demo", "onnx", HW).path == mine  # the user's own measurement wins


def test_a_profile_applies_only_to_a_cpu_with_the_same_features(tmp_path, monkeypatch):
    # Two virtual machines both calling themselves "AMD EPYC" ran the same model 5x apart: AVX-512 VNNI vs AVX2.
    monkeypatch.setattr(profiling, "profile_dirs", lambda: [tmp_path])
    zen4 = {**HW, "cpu_flags": {"avx2": True, "avx512f": True, "avx512_vnni": True, "avx512_bf16": True}}
    avx2 = {**HW, "cpu_flags": {"avx2": True, "avx512f": False, "avx512_vnni": False}}
    data = sample_profile()
    data["machine"]["key"] = profiling.machine_key(zen4)
    profiling.write_profile(data, tmp_path / "demo.toml")
    assert profiling.find_profile("demo", "onnx", zen4) is not None
    assert profiling.find_profile("demo", "onnx", avx2) is None
    assert profiling.default_path(data).name == "test-cpu-2c-avx512-bf16-demo-onnx.toml"


def test_a_profile_that_predates_cpu_features_is_ignored_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "profile_dirs", lambda: [tmp_path])
    hw = {**HW, "cpu_flags": {"avx2": True}}
    data = sample_profile()
    data["machine"]["key"] = "Test CPU|2c|cpu"  # the key profiles had before it named the CPU's features
    profiling.write_profile(data, tmp_path / "old.toml")
    warnings = []
    assert profiling.find_profile("demo", "onnx", hw, warn=warnings.append) is None
    assert len(warnings) == 1 and "old.toml" in warnings[0] and "avx2" in warnings[0] and "edgespec profile" in warnings[0]


def test_the_drafter_is_chosen_over_a_whole_answer_including_its_prefill_of_the_prompt():
    # Per round int8 wins (1.6x vs 1.33x), but it must first take in the prompt; n-gram need not.
    data = sample_profile(verify=(0, 20, 22, 24, 26, 28), draft_per_token=3.0)
    data["drafters"]["int8"]["acceptance"]["greedy"] = [0.8, 0.6, 0.4, 0.2]
    data["drafters"]["ngram"]["acceptance"]["greedy"] = [0.4, 0.2, 0.1, 0.05]
    profiling.predict(data, 4)
    assert data["choice"]["greedy"]["drafter"] == "int8"
    per_round = data["choice"]["greedy"]["speedup"]
    data["settings"] = {"typical_prompt_tokens": 400}
    data["drafters"]["int8"]["catch_up_ms_per_token"] = {"128": 2.0, "512": 2.0}  # 800 ms a request
    data["drafters"]["ngram"]["catch_up_ms_per_token"] = {"128": 0.0, "512": 0.0}
    profiling.predict(data, 4)
    choice = data["choice"]["greedy"]
    assert choice["drafter"] == "ngram" and choice["speedup"] == choice["request_speedup"]
    # 128 tokens at 20 ms plain = 2.56 s; int8's rounds take 2.56 / per_round, plus 0.8 s of prefill.
    assert profiling.request_speedup(per_round, 0.8, 0.020) == pytest.approx(2.56 / (2.56 / per_round + 0.8))
    assert "int8 800 ms, ngram 0 ms" in profiling.table(data)


def test_a_profile_without_prefill_measurements_still_reads_and_predicts(tmp_path):
    data = sample_profile()
    path = profiling.write_profile(data, tmp_path / "old.toml")
    prof = profiling.read_profile(path)
    assert prof.catch_up_ms("int8") == 0.0 and prof.choice("greedy")["drafter"] == "int8"


def with_split(data, verify, draft_per_token, threads=1, draft_threads=1):
    """`data` with an `[overlap]` section: the cores split, these latencies (ms) for the int8 drafter."""
    data["overlap"] = {"draft_threads": draft_threads, "context": 512, "verify": list(verify),
                       "verify_spread": [0.0] * len(verify),
                       "drafters": {"int8": {"propose": [k * draft_per_token for k in range(5)]}}}
    if threads is not None:
        data["overlap"]["threads"] = threads
    profiling.predict(data, 4)
    return data


GPU_SPLIT = {"verify": (0, 20, 22, 24, 26, 28), "draft_per_token": 3.0, "threads": None, "draft_threads": 1}


def test_overlap_is_chosen_only_where_the_split_is_predicted_to_beat_sequential_drafting():
    from edgespec.costmodel import Latencies, expected_tokens, round_cost

    # A target on the GPU loses nothing to the draft's thread: drafting hides under verification.
    data = with_split(sample_profile(), **GPU_SPLIT)
    surv = [0.9, 0.8, 0.7, 0.6]
    split = Latencies([k * 0.003 for k in range(5)], [0, 0.020, 0.022, 0.024, 0.026, 0.028])
    k4 = expected_tokens(surv, 4) * 0.020 / round_cost(split, 4, overlap=True, survival=surv)
    pred = data["overlap"]["predicted"]["int8"]["greedy"]
    assert pred[0] == pytest.approx(1.0)  # K = 0: plain decoding, the target on the same device
    assert pred[4] == pytest.approx(k4, abs=1e-4) and pred[4] == max(pred)
    greedy = data["choice"]["greedy"]
    assert k4 > 2.0 * (1 + profiling.OVERLAP_MARGIN)  # the sequential choice's 2.0x (test_predict_chooses_...)
    assert greedy == {"drafter": "int8", "k": 4, "speedup": round(k4, 4), "request_speedup": round(k4, 4),
                      "overlap": True, "draft_threads": 1, "sequential_speedup": pytest.approx(2.0)}
    # At T=0.7 the drafts are rarely accepted: overlap predicts a loss, n-gram one after the other stays.
    assert data["choice"]["sampling"]["drafter"] == "ngram" and "overlap" not in data["choice"]["sampling"]
    assert data["choice"]["sampling"]["overlap_speedup"] < 1.0
    assert "overlap on for greedy" in profiling.table(data)


def test_overlap_stays_off_where_splitting_the_cores_slows_the_target_more_than_it_gains():
    # A 2-core CPU: the target on one core verifies at 1.6x the time, the draft on one core at 1.3x.
    data = with_split(sample_profile(), verify=(0, 32, 35, 38, 42, 45), draft_per_token=3.9)
    assert data["overlap"]["predicted"]["int8"]["greedy"][0] == pytest.approx(20 / 32)  # K = 0 on one core
    greedy = data["choice"]["greedy"]
    assert "overlap" not in greedy and greedy["drafter"] == "int8" and greedy["k"] == 4
    assert 1.0 < greedy["overlap_speedup"] < greedy["request_speedup"] * (1 + profiling.OVERLAP_MARGIN)
    assert "overlap off for greedy" in profiling.table(data)


def test_an_overlap_section_round_trips_and_feeds_the_overlapped_policy(tmp_path):
    data = with_split(sample_profile(), verify=(0, 30, 33, 36, 39, 42), draft_per_token=6.0)
    prof = profiling.read_profile(profiling.write_profile(data, tmp_path / "p.toml"))
    assert prof.data == data
    assert prof.latencies("int8", overlap=True).verify[1] == pytest.approx(0.030)
    assert prof.latencies("int8").verify[1] == pytest.approx(0.020)  # sequential: every core
    ngram = prof.latencies("ngram", overlap=True)  # a Python lookup: the split target, its own proposal cost
    assert ngram.verify[1] == pytest.approx(0.030) and list(ngram.draft) == list(prof.latencies("ngram").draft)
    policy = profiling.policy_from_profile(prof, "int8", 0.0, k_max=4, overlap=True)
    assert policy.overlap and policy.verify[1] == pytest.approx(0.030)
    data["overlap"]["verify"][2] = -1.0
    profiling.write_profile(data, tmp_path / "bad.toml")
    with pytest.raises(EdgespecError, match="overlap latency"):
        profiling.read_profile(tmp_path / "bad.toml")


def test_a_profile_that_chose_overlap_turns_it_on_with_its_split_unless_told_otherwise(tmp_path, capsys):
    from edgespec.runtime import RuntimeSpec, select_profile

    data = with_split(sample_profile(), **{**GPU_SPLIT, "threads": 1})  # as if the target kept its speed on 1 core
    path = profiling.write_profile(data, tmp_path / "p.toml")
    spec = RuntimeSpec(pair="smollm2-135m")
    select_profile(spec, str(path), 0.0)
    assert (spec.draft, spec.overlap, spec.threads, spec.draft_threads) == ("int8", True, 1, 1)
    assert "overlap on" in capsys.readouterr().err
    spec = RuntimeSpec(pair="smollm2-135m", overlap=False)  # --no-overlap
    select_profile(spec, str(path), 0.0)
    assert (spec.draft, spec.overlap, spec.threads) == ("int8", False, None)
    spec = RuntimeSpec(pair="smollm2-135m", threads=2, draft_threads=2)  # threads given: they stay
    select_profile(spec, str(path), 0.0)
    assert (spec.overlap, spec.threads, spec.draft_threads) == (True, 2, 2)
    spec = RuntimeSpec(pair="smollm2-135m", draft="ngram")  # another drafter than the one overlap was chosen for
    select_profile(spec, str(path), 0.0)
    assert spec.overlap is False
    spec = RuntimeSpec(pair="smollm2-135m")
    select_profile(spec, str(path), 0.7)  # the sampling band chose n-gram, one after the other
    assert (spec.draft, spec.overlap) == ("ngram", False)


def test_overlap_pays_for_the_targets_slower_prefill_on_its_share_of_the_cores():
    # Per round the GPU split wins (test above); over a whole answer it must also repay what the start costs more.
    data = with_split(sample_profile(), **GPU_SPLIT)
    per_round = data["choice"]["greedy"]["speedup"]
    data["latency"]["prefill_ms"] = 100.0
    data["overlap"]["drafters"]["int8"]["prefill_ms"] = 150.0  # 50 ms more before the first token
    profiling.predict(data, 4)
    greedy = data["choice"]["greedy"]
    whole = profiling.request_speedup(per_round, 0.05, 0.020)
    assert greedy["overlap"] and greedy["speedup"] == pytest.approx(per_round, abs=1e-4)
    assert greedy["request_speedup"] == pytest.approx(whole, abs=1e-4) and whole < per_round
    assert "a whole answer" in profiling.table(data) and "150.0 ms split" in profiling.table(data)
    data["overlap"]["drafters"]["int8"]["prefill_ms"] = 2100.0  # 2 s more: no longer worth it
    profiling.predict(data, 4)
    greedy = data["choice"]["greedy"]
    assert "overlap" not in greedy and greedy["drafter"] == "int8"
    assert greedy["overlap_speedup"] == pytest.approx(per_round, abs=1e-4)
    assert greedy["overlap_request_speedup"] < greedy["request_speedup"] * (1 + profiling.OVERLAP_MARGIN)


def test_running_beside_keeps_the_other_model_busy_and_reports_its_failure():
    import threading

    calls, again = [], threading.Event()

    def work():
        calls.append(threading.current_thread().name)
        if len(calls) >= 2:
            again.set()

    with profiling.running_beside(work):
        assert again.wait(120)  # a cap for a hung test, not a wait: the work runs over and over at once
    assert len(calls) >= 2 and set(calls) == {"edgespec-profile-beside"}
    # stopped with the body: the thread is gone once the block is left, so nothing can call `work` again
    assert not [t for t in threading.enumerate() if t.name == "edgespec-profile-beside"]

    def broken():
        raise RuntimeError("draft session lost")

    with pytest.raises(RuntimeError, match="draft session lost"), profiling.running_beside(broken):
        pass


def with_p_min_variant(data, survival, reach):
    """The int8 drafter measured again with drafts stopped early (p_min 0.75): other survival and reach."""
    d = data["drafters"]["int8"]
    d["by_p_min"] = {"0": {"acceptance": {b: list(v) for b, v in d["acceptance"].items()},
                           "reach": {b: [1.0] * 4 for b in d["acceptance"]}},
                     "0.75": {"acceptance": {b: list(survival) for b in d["acceptance"]},
                              "reach": {b: list(reach) for b in d["acceptance"]}}}
    profiling.predict(data, 4)
    return data


def test_the_profile_keeps_p_min_only_where_stopping_drafts_early_is_predicted_faster():
    # Dear drafting (8 ms a token against 20 ms a plain step) and a draft that is often wrong late in a
    # proposal: stopping after unsure tokens drafts half as much for nearly the same accepted tokens.
    data = sample_profile(draft_per_token=8.0)
    d = data["drafters"]["int8"]
    d["acceptance"]["greedy"] = [0.8, 0.5, 0.3, 0.2]
    profiling.predict(data, 4)
    before = data["choice"]["greedy"]
    with_p_min_variant(data, survival=[0.78, 0.48, 0.28, 0.19], reach=[1.0, 0.6, 0.35, 0.25])
    prof = profiling.Profile(data)
    assert prof.p_min("int8", "greedy") == 0.75
    assert prof.survival("int8", "greedy") == [0.78, 0.48, 0.28, 0.19]
    assert data["choice"]["greedy"]["request_speedup"] > before["request_speedup"]
    assert "p_min 0.75" in profiling.table(data)
    # the policy seeded from it stops drafts there, unless told otherwise
    assert profiling.policy_from_profile(prof, "int8", 0.0, k_max=4).p_min == 0.75
    assert profiling.policy_from_profile(prof, "int8", 0.0, k_max=4, p_min=0.0).p_min == 0.0
    # a draft that is right even where it is unsure (a quantised copy of the target): stopping only loses
    data = with_p_min_variant(sample_profile(), survival=[0.85, 0.6, 0.4, 0.25], reach=[1.0, 0.7, 0.5, 0.3])
    prof = profiling.Profile(data)
    assert prof.p_min("int8", "greedy") == 0.0
    assert prof.survival("int8", "greedy") == [0.9, 0.8, 0.7, 0.6]
    assert profiling.policy_from_profile(prof, "int8", 0.0, k_max=4).p_min == 0.0


def test_a_p_min_choice_round_trips(tmp_path):
    data = with_p_min_variant(sample_profile(draft_per_token=15.0), survival=[0.9, 0.8, 0.7, 0.6],
                              reach=[1.0, 0.5, 0.3, 0.2])
    path = tmp_path / "p.toml"
    profiling.write_profile(data, path)
    again = profiling.read_profile(path)
    assert again.p_min("int8", "sampling") == profiling.Profile(data).p_min("int8", "sampling")
    assert again.data["drafters"]["int8"]["by_p_min"] == data["drafters"]["int8"]["by_p_min"]


def test_a_model_drafter_must_beat_a_free_one_by_the_margin():
    data = sample_profile(draft_per_token=3.0)
    ngram, int8 = data["drafters"]["ngram"], data["drafters"]["int8"]
    ngram["propose"] = {"128": [0.0] + [0.003] * 4, "512": [0.0] + [0.003] * 4}  # a lookup: 3 us, not 0
    ngram["acceptance"]["greedy"] = [0.25, 0.0, 0.0, 0.0]  # K=1: 1.25 tokens for 22 ms against 20: 1.136x
    ngram["reach"]["greedy"] = [1.0] * 4
    int8["acceptance"]["greedy"] = [0.47, 0.0, 0.0, 0.0]  # K=1: 1.47 tokens for 3 + 22 ms: 1.176x, < 5% ahead
    profiling.predict(data, 4)
    assert data["choice"]["greedy"]["drafter"] == "ngram"
    int8["acceptance"]["greedy"] = [0.66, 0.0, 0.0, 0.0]  # 1.66 tokens for 25 ms: 1.328x, > 1.136x * 1.05
    profiling.predict(data, 4)
    assert data["choice"]["greedy"]["drafter"] == "int8"
    # and against plain decoding alone: a model drafter predicted 1.03x is not chosen
    data["drafters"].pop("ngram")
    int8["acceptance"]["greedy"] = [0.29, 0.0, 0.0, 0.0]  # 1.29 tokens for 25 ms: 1.032x
    profiling.predict(data, 4)
    assert data["choice"]["greedy"]["drafter"] == "none"


def test_run_profile_measures_and_writes_from_python(tiny_checkpoints, tmp_path, capsys):
    """The profile procedure without the command line: explicit parameters, the data and the path written back,
    the caller's spec left as given; no overlapped split measured when the spec says --no-overlap."""
    from edgespec.runtime import RuntimeSpec

    spec = RuntimeSpec(target=str(tiny_checkpoints["target"]), target_backend="torch", draft="ngram", overlap=False)
    hw = {**HW, "torch": "2.x", "onnxruntime": "1.x", "transformers": "4.x"}  # as `hardware.describe` gives them
    data, path = profiling.run_profile(spec, k_max=1, quick=True, out=tmp_path / "p.toml", hw=hw,
                                       command="from python", progress=False)
    assert (spec.draft, spec.overlap) == ("ngram", False)
    assert path == tmp_path / "p.toml" and path.with_suffix(".png").exists()
    assert profiling.read_profile(path).data["drafters"].keys() == data["drafters"].keys() == {"ngram"}
    assert data["command"] == "from python" and data["machine"]["key"] == profiling.machine_key(HW)
    assert data["settings"]["k_max"] == 1 and len(data["latency"]["verify"]["256"]) == 3
    assert "overlap" not in data and "by_p_min" not in data["drafters"]["ngram"]  # a lookup has no p_min to try
    assert "profile:" not in capsys.readouterr().err  # progress=False: no bar
    report = profiling.terminal_report(data)
    assert report.startswith(profiling.table(data)) and "greedy: predicted speed-up by K with ngram" in report
    with pytest.raises(EdgespecError, match="drop --exact"):
        profiling.run_profile(RuntimeSpec(target=str(tiny_checkpoints["target"]), exact=True), hw=HW)
    with pytest.raises(EdgespecError, match="out of range"):
        profiling.run_profile(spec, k_max=99, hw=HW)


def test_profile_listing_marks_the_profile_that_applies_here(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "profile_dirs", lambda: [tmp_path])
    assert profiling.profile_listing(HW).splitlines()[:2] == [
        "no profiles yet; run `edgespec profile --pair PAIR`", f"this machine: {profiling.machine_key(HW)}"]
    profiling.write_profile(sample_profile(), tmp_path / "here.toml")
    other = sample_profile()
    other["machine"]["key"] = "elsewhere"
    profiling.write_profile(other, tmp_path / "there.toml")
    (tmp_path / "bad.toml").write_text("not toml [")
    lines = profiling.profile_listing(HW).splitlines()
    assert len(lines) == 5 and lines[-2] == f"this machine: {profiling.machine_key(HW)}"
    assert str(profiling.user_profiles_dir()) in lines[-1] and str(profiling.PROFILES_DIR) in lines[-1]
    assert lines[0].startswith(str(tmp_path / "bad.toml") + ": ")
    assert "[applies here]  pair demo" in lines[1] and "here.toml" in lines[1]
    assert "[other machine]" in lines[2] and "there.toml" in lines[2]
