"""Profiles are validated on load: a bad field is a one-line message naming the file and the field, and the
profile is not used (K is calibrated online instead). A NaN latency used to load and yield K = 4."""

import copy
import math

import pytest
from test_profiling import HW, sample_profile, with_split

from edgespec import profiling
from edgespec.errors import EdgespecError
from edgespec.policy import AdaptiveK


def _set(path: str, value):
    """A mutation of a profile: set (or, for value DELETE, remove) the dotted `path` ('a.b[2]' indexes a list)."""

    def mutate(data):
        *parents, last = _split(path)
        node = data
        for key in parents:
            node = node[key]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
        return data

    return mutate


def _split(path):
    out = []
    for part in path.split("."):
        if "[" in part:
            name, index = part[:-1].split("[")
            out += [name, int(index)]
        else:
            out.append(part)
    return out


DELETE = object()

# (mutation, the field the message must name)
BAD = {
    "nan latency": (_set("latency.verify.128[2]", math.nan), "latency.verify.128[2]"),
    "inf latency": (_set("latency.verify.512[3]", math.inf), "latency.verify.512[3]"),
    "negative latency": (_set("drafters.int8.propose.128[2]", -1.0), "drafters.int8.propose.128[2]"),
    "nan draft latency": (_set("drafters.ngram.propose.512[1]", math.nan), "drafters.ngram.propose.512[1]"),
    "zero one-token verify": (_set("latency.verify.512[1]", 0.0), "latency.verify.512[1]"),
    "boolean latency": (_set("latency.verify.128[1]", True), "latency.verify.128[1]"),
    "string latency": (_set("latency.verify.128[1]", "20"), "latency.verify.128[1]"),
    "latency row not a list": (_set("latency.verify.128", 20.0), "latency.verify.128"),
    "too short for K = 1": (_set("latency.verify.128", [0.0, 20.0]), "latency.verify.128"),
    "no context lengths": (_set("latency.verify", {}), "latency.verify"),
    "context length not a number": (_set("latency.verify.abc", [0.0, 20.0, 22.0]), "'abc'"),
    "propose misses a context": (_set("drafters.int8.propose.512", DELETE), "drafters.int8.propose.512"),
    "negative prefill": (_set("latency.prefill_ms", -3.0), "latency.prefill_ms"),
    "acceptance above 1": (_set("drafters.int8.acceptance.greedy[0]", 1.5), "drafters.int8.acceptance.greedy[0]"),
    "acceptance negative": (_set("drafters.ngram.acceptance.sampling[3]", -0.1),
                            "drafters.ngram.acceptance.sampling[3]"),
    "acceptance nan": (_set("drafters.int8.acceptance.sampling[1]", math.nan), "drafters.int8.acceptance.sampling[1]"),
    "acceptance a string": (_set("drafters.int8.acceptance.greedy", "high"), "drafters.int8.acceptance.greedy"),
    "acceptance empty": (_set("drafters.int8.acceptance.greedy", []), "drafters.int8.acceptance.greedy"),
    "reach above 1": (_set("drafters.ngram.reach.greedy[0]", 2.0), "drafters.ngram.reach.greedy[0]"),
    "p_min above 1": (_set("drafters.int8.p_min", {"greedy": 1.5}), "drafters.int8.p_min.greedy"),
    "missing acceptance band": (_set("drafters.int8.acceptance.sampling", DELETE), "drafters.int8.acceptance.sampling"),
    "missing reach band": (_set("drafters.ngram.reach.greedy", DELETE), "drafters.ngram.reach.greedy"),
    "missing predicted band": (_set("drafters.ngram.predicted.sampling", DELETE), "drafters.ngram.predicted.sampling"),
    "missing choice band": (_set("choice.sampling", DELETE), "choice.sampling"),
    "missing latency table": (_set("latency", DELETE), "[latency]"),
    "missing drafters table": (_set("drafters", DELETE), "[drafters]"),
    "missing choice table": (_set("choice", DELETE), "[choice]"),
    "missing pair table": (_set("pair", DELETE), "[pair]"),
    "missing machine table": (_set("machine", DELETE), "[machine]"),
    "missing acceptance table": (_set("drafters.int8.acceptance", DELETE), "drafters.int8.acceptance"),
    "missing propose table": (_set("drafters.ngram.propose", DELETE), "drafters.ngram.propose"),
    "missing machine key": (_set("machine.key", DELETE), "machine.key"),
    "pair name a number": (_set("pair.name", 3), "pair.name"),
    "drafters a list": (_set("drafters", ["int8"]), "drafters"),
    "a drafter a string": (_set("drafters.int8", "fast"), "drafters.int8"),
    "choice k a float": (_set("choice.greedy.k", 4.0), "choice.greedy.k"),
    "choice k a string": (_set("choice.greedy.k", "4"), "choice.greedy.k"),
    "choice k a boolean": (_set("choice.greedy.k", True), "choice.greedy.k"),
    "choice k too large": (_set("choice.sampling.k", 99), "choice.sampling.k"),
    "choice k negative": (_set("choice.sampling.k", -1), "choice.sampling.k"),
    "choice of an unmeasured drafter": (_set("choice.greedy.drafter", "int2"), "choice.greedy.drafter"),
    "choice speed-up a string": (_set("choice.greedy.speedup", "fast"), "choice.greedy.speedup"),
    "choice overlap a string": (_set("choice.greedy.overlap", "yes"), "choice.greedy.overlap"),
    "schema from the future": (_set("schema", 2), "schema"),
    "schema a string": (_set("schema", "1"), "schema"),
}

BAD_OVERLAP = {
    "overlap verify nan": (_set("overlap.verify[2]", math.nan), "overlap.verify[2]"),
    "overlap verify negative": (_set("overlap.verify[3]", -2.0), "overlap.verify[3]"),
    "overlap propose inf": (_set("overlap.drafters.int8.propose[1]", math.inf), "overlap.drafters.int8.propose[1]"),
    "overlap draft threads a string": (_set("overlap.draft_threads", "one"), "overlap.draft_threads"),
    "overlap draft threads missing": (_set("overlap.draft_threads", DELETE), "overlap.draft_threads"),
    "overlap threads zero": (_set("overlap.threads", 0), "overlap.threads"),
    "overlap verify missing": (_set("overlap.verify", DELETE), "overlap.verify"),
}


def good_profile():
    return with_split(sample_profile(), verify=(0, 30, 33, 36, 39, 42), draft_per_token=6.0)


def written(tmp_path, data, name="p.toml"):
    """`data` written as a profile file, without the writer's own checks in the way (tomli_w writes nan/inf)."""
    return profiling.write_profile(data, tmp_path / name)


def assert_names(err: str, path, field: str) -> None:
    assert "\n" not in err
    assert str(path) in err and field in err and "edgespec profile" in err


def test_every_committed_profile_loads():
    paths = sorted(profiling.PROFILES_DIR.glob("*.toml"))
    assert len(paths) >= 8
    for path in paths:
        prof = profiling.read_profile(path)
        for band in profiling.BANDS:
            assert prof.choice(band)["drafter"] in ("none", *prof.data["drafters"])


def test_the_good_sample_passes_and_is_unchanged_by_the_check(tmp_path):
    data = good_profile()
    before = copy.deepcopy(data)
    prof = profiling.read_profile(written(tmp_path, data))
    assert prof.data == before


@pytest.mark.parametrize("case", [*BAD, *BAD_OVERLAP])
def test_a_bad_field_is_a_one_line_error_naming_the_file_and_the_field(tmp_path, case):
    mutate, field = {**BAD, **BAD_OVERLAP}[case]
    path = written(tmp_path, mutate(good_profile()))
    with pytest.raises(EdgespecError) as err:
        profiling.read_profile(path)
    assert_names(str(err.value), path, field)


def test_a_nan_latency_no_longer_yields_a_policy_with_k(tmp_path, capsys):
    """The reviewer's case: a NaN in the verify table loaded and the adaptive policy chose K = 4 from it. Now the
    profile is refused with a warning and K is calibrated online (0, 2, 4 first), as without a profile."""
    from edgespec.runtime import RuntimeSpec, make_policy, select_profile

    data = good_profile()
    data["latency"]["verify"]["128"][1] = math.nan
    data["latency"]["verify"]["512"][1] = math.nan
    path = written(tmp_path, data)
    spec = RuntimeSpec(pair="smollm2-135m")
    profile = select_profile(spec, str(path), 0.0)
    assert profile is None
    assert spec.draft is None  # the bad profile's choice of drafter is not used either
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1
    assert_names(warnings[0], path, "latency.verify.")
    assert "calibrating K online" in warnings[0]
    policy = make_policy("auto", profile, "int8", 0.0)
    assert isinstance(policy, AdaptiveK)
    assert [policy.next_k() for _ in range(3)] == [0, 2, 4]


def test_a_bad_profile_found_by_machine_is_skipped_with_a_warning_and_a_good_one_still_used(tmp_path, monkeypatch):
    monkeypatch.setattr(profiling, "profile_dirs", lambda: [tmp_path])
    bad = good_profile()
    bad["drafters"]["int8"]["acceptance"]["greedy"][0] = 1.2
    bad_path = written(tmp_path, bad, "a-bad.toml")
    good_path = written(tmp_path, good_profile(), "b-good.toml")
    warnings = []
    prof = profiling.find_profile("demo", "onnx", HW, warn=warnings.append)
    assert prof is not None and prof.path == good_path
    assert len(warnings) == 1
    assert_names(warnings[0], bad_path, "drafters.int8.acceptance.greedy[0]")
    good_path.unlink()
    warnings.clear()
    assert profiling.find_profile("demo", "onnx", HW, warn=warnings.append) is None  # the bad one is not used
    assert len(warnings) == 1


def test_profile_show_lists_a_bad_profile_with_its_field(tmp_path, monkeypatch, capsys):
    from edgespec.cli import main

    monkeypatch.setattr(profiling, "profile_dirs", lambda: [tmp_path])
    data = good_profile()
    del data["drafters"]["ngram"]["acceptance"]["sampling"]
    path = written(tmp_path, data)
    assert main(["profile", "--show"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if str(path) in line]
    assert len(lines) == 1 and "drafters.ngram.acceptance.sampling" in lines[0]


def test_an_explicitly_named_unreadable_profile_is_a_one_line_message(tmp_path):
    for path, content in ((tmp_path / "missing.toml", None), (tmp_path / "binary.toml", b"\xff\xfe\x00garbage"),
                          (tmp_path / "syntax.toml", b"schema = [1,")):
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(EdgespecError) as err:
            profiling.read_profile(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
    with pytest.raises(EdgespecError):
        profiling.read_profile(tmp_path)  # a directory


def test_where_no_drafter_pays_the_default_is_the_free_ngram_lookup_not_the_pairs_model_draft(tmp_path):
    """A profile that chooses no drafter for a band: the pair's first drafter (a model, for SmolLM2 its INT8 copy)
    would be loaded only to be probed, which cost 3-5% on the machine measured; the n-gram lookup is kept instead.
    A chosen drafter, and a drafter the user names, are used as they are."""
    from edgespec.runtime import RuntimeSpec, select_profile

    data = good_profile()
    data["choice"]["sampling"] = {"drafter": "none", "k": 0, "speedup": 1.0, "request_speedup": 1.0}
    assert data["choice"]["greedy"]["drafter"] == "int8"
    path = written(tmp_path, data)
    for temperature, chosen in ((0.7, "ngram"), (0.0, "int8")):
        spec = RuntimeSpec(pair="smollm2-135m")
        assert select_profile(spec, str(path), temperature) is not None
        assert spec.draft == chosen, temperature
    spec = RuntimeSpec(pair="smollm2-135m", draft="int4")
    select_profile(spec, str(path), 0.7)
    assert spec.draft == "int4"
    spec = RuntimeSpec(pair="smollm2-135m")
    select_profile(spec, str(path), 0.7, choose_drafter=False)
    assert spec.draft is None
