"""Fuzzed inputs never produce a traceback: command lines, model-pair manifests and profiles (hypothesis).

A command line runs `edgespec.cli.main` in-process with the model build replaced (nothing is resolved,
converted or loaded: `_Reached` marks arguments that passed every check before a model would load). It must
end in an exit code (an `EdgespecError` is one line `edgespec: error: ...`, code 2), argparse's usage error
(SystemExit 2), or `_Reached`. A manifest must parse or raise EdgespecError; a profile must load or raise
EdgespecError, and one that loads must work wherever the runtime reads it (K policy, latencies, the choice).
`--hypothesis-show-statistics` prints how many inputs each test tried.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import math
import os
import tempfile
from unittest import mock

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgespec import models, profiling
from edgespec.errors import EdgespecError

# EDGESPEC_FUZZ_EXAMPLES=5000 for a deeper run than the suite's (which keeps this file near half a minute).
_EXAMPLES = int(os.environ.get("EDGESPEC_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=_EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SMALL = settings(max_examples=_EXAMPLES // 2, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class _Reached(Exception):
    """The arguments passed every check; a model would load now."""


def _reached(*args, **kwargs):
    raise _Reached()


class _NoApp:
    def __init__(self, *args, **kwargs):
        raise _Reached()


# The cache fuzzed commands see: `edgespec models --clean` and `--remove smollm2-135m` run to their end, and
# against the user's cache (shared with the other tests) they deleted every model in it, the suite's SmolLM2
# conversions included (rebuilt minutes later by the next test that needed them).
_FUZZ_CACHE = tempfile.mkdtemp(prefix="edgespec-fuzz-cache-")


@contextlib.contextmanager
def no_models():
    """Every seam where a run starts resolving, converting or loading a model (or the chat UI starts) raises
    `_Reached`: checks before it still run, nothing after it does. The cache is a scratch one."""
    import tui.app

    from edgespec import loading, runtime

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {"EDGESPEC_CACHE": _FUZZ_CACHE}))
        for owner, name in ((runtime, "_model_dir"), (runtime, "_build_lm"), (loading, "load_tokenizer"), (loading, "load_causal_lm"), (models, "resolve"),
                            (models, "download_wheel")):
            stack.enter_context(mock.patch.object(owner, name, _reached))
        stack.enter_context(mock.patch.object(tui.app, "ChatApp", _NoApp))
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths a fuzzed argument may name: missing ones, a directory, garbage files of each kind read."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "empty-dir").mkdir()
    (root / "ckpt").mkdir()
    (root / "ckpt" / "config.json").write_text("{not json")
    (root / "garbage.toml").write_bytes(b"\xff\x00schema = [")
    (root / "half.toml").write_text("schema = 1\n[pair]\nname = 3\n")
    (root / "model.gguf").write_bytes(b"GGUF" + b"\x00" * 20)
    (root / "notgguf.gguf").write_bytes(b"hello")
    (root / "list.json").write_text("[]")
    (root / "obj.json").write_text('{"records": [{"x": 1}]}')
    (root / "text.json").write_text('"text"')
    profile = _good_profile()
    profiling.write_profile(profile, root / "good.toml")
    bad = copy.deepcopy(profile)
    bad["latency"]["verify"]["128"][1] = math.nan
    profiling.write_profile(bad, root / "nan.toml")
    return [str(root / name) for name in ("missing", "missing.toml", "missing.json", "empty-dir", "ckpt",
                                           "garbage.toml", "half.toml", "model.gguf", "notgguf.gguf", "list.json",
                                           "obj.json", "text.json", "good.toml", "nan.toml")]


# --------------------------------------------------------------------------------------------- command lines

WORDS = ["0", "1", "2", "-1", "16", "17", "8", "99999999999999999999999", "-0", "0.5", "1.5", "-0.5", "0.0", "1e-9",
         "nan", "NaN", "inf", "-inf", "1e400", "auto", "", " ", "0,2,auto", "auto,auto", "3,,4", "1,x", ",", "0.75,0",
         "int4", "int8", "torch", "ngram", "none", "onnx", "cpu", "cuda", "cuda:0", "cuda:-1", "cuda:x", "float16",
         "bfloat16", "float64", "smollm2-135m", "qwen2.5-coder-1.5b", "nope", "../x", "../../etc/passwd",
         "/", "/dev/null", "~nouser_edgespec/x", "~", "x.toml", "a/b.toml", "qa,code", "qa,,nope", "\x00", "é",
         "--", "-", "latest", "chat-1"]


def _parser_options():
    """{command: [(option, takes_value, choices)]} from the CLI's own parser, so new options are fuzzed too."""
    import argparse

    from edgespec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, p in sub.choices.items():
        opts = []
        for action in p._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            takes = action.nargs != 0
            kind = "number" if action.type in (int, float) else "text"
            opts.append((action.option_strings[-1], takes, list(action.choices or []), kind))
        out[name] = opts
    return out


OPTIONS = _parser_options()


NUMBERS = ["0", "1", "2", "-1", "16", "17", "8", "99999999999999999999999", "-0", "0.5", "1.5", "-0.5", "1e-9",
           "nan", "inf", "-inf", "1e400", "9223372036854775807", "9223372036854775806", "-9223372036854775809"]


@st.composite
def command_lines(draw, files):
    """A subcommand (now and then an unknown one), up to 6 of its options with values (mostly of the option's
    type, or one of its choices), sometimes a stray word: most reach the checks after argparse's."""
    value = st.one_of(st.sampled_from(WORDS), st.sampled_from(files), st.text(max_size=8),
                      st.integers(-10**20, 10**20).map(str), st.floats().map(repr))
    number = st.one_of(st.sampled_from(NUMBERS), st.integers(-10**20, 10**20).map(str), st.floats().map(repr))
    command = draw(st.sampled_from([*OPTIONS] * 4 + ["bogus"]))
    argv = [command]
    for option, takes, choices, kind in draw(st.lists(st.sampled_from(OPTIONS.get(command, [("--nope", True, [], "")])),
                                                      max_size=6)):
        argv.append(option)
        if takes:
            if choices and draw(st.booleans()):
                argv.append(draw(st.sampled_from(choices)))
            else:
                argv.append(draw(number if kind == "number" and draw(st.integers(0, 4)) else value))
    if command in ("generate",) and draw(st.integers(0, 5)):
        argv += ["--prompt", draw(value)]
    if command == "prepare" and draw(st.booleans()):
        argv.append(draw(value))  # the pair, positional
    if draw(st.integers(0, 9)) == 0:
        argv.insert(draw(st.integers(1, len(argv))), draw(value))  # a stray word anywhere
    return argv


def run_main(argv):
    """(outcome, stderr): outcome is ("exit", code), ("argparse", code) or ("reached", None)."""
    from edgespec.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), no_models():
        try:
            code = main(argv)
        except SystemExit as exit_:
            return ("argparse", exit_.code), err.getvalue()
        except _Reached:
            return ("reached", None), err.getvalue()
    return ("exit", code), err.getvalue()


def test_a_fuzzed_command_line_never_touches_the_users_cache(tmp_path, monkeypatch):
    """`models --clean` and `--remove` run to their end in the fuzz: on a scratch cache, not the user's."""
    import json

    users = tmp_path / "users-cache"
    model = users / "models" / "0123456789abcdef-mine.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF")
    model.with_name(model.name + ".verified").write_text(json.dumps({"origin": "downloaded", "sha256": "00"}))
    monkeypatch.setenv("EDGESPEC_CACHE", str(users))
    assert run_main(["models", "--clean"])[0] == ("exit", 0)
    assert run_main(["models", "--remove", model.name])[0][0] == "exit"  # (not in the scratch cache: exit 2)
    assert model.read_bytes() == b"GGUF"


def test_the_model_build_is_really_replaced():
    """The fuzz below relies on it: a plain generate with valid arguments reaches the patched seam, loads nothing."""
    (kind, _), _ = run_main(["generate", "--prompt", "hi", "--k", "2"])
    assert kind == "reached"


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi", "--pair", "~nouser_edgespec/x.toml"],  # found by the manifest fuzz:
    ["generate", "--prompt", "hi", "--target", "~nouser_edgespec/model"],  # pathlib's RuntimeError on ~user
    ["prepare", "~nouser_edgespec/pair.toml"],
])
def test_paths_with_an_unknown_user_are_a_one_line_error(argv):
    (kind, code), err = run_main(argv)
    assert (kind, code) == ("exit", 2)
    (line,) = [line for line in err.splitlines() if line.startswith("edgespec: error:")]
    assert "~nouser_edgespec" in line and "full path" in line and "Traceback" not in err


@FUZZ
@given(data=st.data())
def test_fuzzed_command_lines_end_in_an_exit_code_never_a_traceback(files, data):
    argv = data.draw(command_lines(files), label="argv")
    (kind, code), err = run_main(argv)
    if kind == "argparse":
        assert code == 2, argv  # no --help among the fuzzed words: argparse only ever rejects
    elif kind == "exit":
        assert code in (0, 2), argv
        if code == 2:
            lines = [line for line in err.splitlines() if line.startswith("edgespec: error:")]
            assert len(lines) == 1, (argv, err)
            assert "Traceback" not in err


# ------------------------------------------------------------------------------------------------ manifests

def toml_values(depth=2):
    """Values a TOML file can hold: what a hand-edited manifest or profile can contain."""
    leaf = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(), st.text(max_size=12),
                     st.sampled_from(WORDS), st.dates(), st.times(),
                     st.datetimes(timezones=st.just(datetime.timezone.utc)))
    return st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=8)


GOOD_MANIFESTS = {
    "wheel": models.tomllib.loads((models.MODELS_DIR / "smollm2-135m.toml").read_text()),
    "hf": {"name": "fuzz", "default_drafters": ["ngram", "int4"],
           "target": {"format": "hf", "source": {"kind": "hf", "repo": "org/model", "revision": "main"}},
           "draft": {"format": "onnx", "source": {"kind": "path", "path": "relative/dir"}}},
}


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, prefix + (i,))


@st.composite
def mutated(draw, base: dict, n_max: int = 3):
    """`base` with 1..n_max random edits: a field replaced by any TOML value, deleted, or a key added."""
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, n_max))):
        paths = [p for p in _paths(data) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(toml_values())
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent[path[-1]], dict):
            parent[path[-1]][draw(st.text(max_size=6))] = draw(toml_values())
    return data


def parse_manifest(data, tmp_path):
    """`data` as `fuzz.toml`: parsed or an EdgespecError; a parsed pair's sources are used as the runtime would."""
    name = data.get("name") if isinstance(data, dict) else None
    path = tmp_path / f"{name if isinstance(name, str) and name else 'fuzz'}.toml"
    try:
        pair = models._parse_pair(data, path)
    except EdgespecError as err:
        assert "\n" not in str(err)
        return None
    for spec in (pair.target, pair.draft_model):
        if spec.source.kind == "pypi-wheel":
            spec.source.cache_path()
    return pair


@FUZZ
@given(data=st.data(), base=st.sampled_from(sorted(GOOD_MANIFESTS)))
def test_fuzzed_manifests_parse_or_are_a_one_line_error(tmp_path, data, base):
    parse_manifest(data.draw(mutated(GOOD_MANIFESTS[base]), label="manifest"), tmp_path)


@SMALL
@given(data=st.dictionaries(st.text(max_size=8), toml_values(), max_size=6))
def test_arbitrary_tables_as_manifests_are_a_one_line_error(tmp_path, data):
    parse_manifest(data, tmp_path)


@SMALL
@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))),
       raw=st.binary(max_size=64))
def test_manifest_files_of_any_content_load_or_are_a_one_line_error(tmp_path, text, raw):
    for name, content in (("fuzz.toml", text.encode("utf-8", "surrogatepass")), ("raw.toml", raw)):
        path = tmp_path / name
        path.write_bytes(content)
        try:
            models.load_manifest(path)
        except EdgespecError as err:
            assert "\n" not in str(err)


@SMALL
@given(name=st.one_of(st.sampled_from(WORDS), st.text(max_size=20)))
def test_any_pair_name_loads_or_is_a_one_line_error(name):
    try:
        models.load_manifest(name)
    except EdgespecError as err:
        assert "\n" not in str(err)


# ------------------------------------------------------------------------------------------------- profiles

def _good_profile():
    from test_profiling import sample_profile, with_split

    return with_split(sample_profile(), verify=(0, 30, 33, 36, 39, 42), draft_per_token=6.0)


GOOD_PROFILES = {"sample": _good_profile(),
                 "committed": models.tomllib.loads(sorted(profiling.PROFILES_DIR.glob("*amx*smollm2*.toml"))[0]
                                                   .read_text())}


def use_profile(prof: profiling.Profile) -> None:
    """What the runtime and the reports do with a loaded profile: none of it may raise."""
    from edgespec import bench
    from edgespec.costmodel import speedups

    for band, temperature in (("greedy", 0.0), ("sampling", 0.7)):
        c = prof.choice(band)
        f"{c['speedup']:.2f} {c.get('request_speedup', 1.0):.2f} {c.get('sequential_speedup', 1.0):.2f}"  # noqa: B018
        for name in prof.data["drafters"]:
            for overlap in (False, True):
                policy = profiling.policy_from_profile(prof, name, temperature, overlap=overlap)
                for _ in range(3):
                    k = policy.next_k(remaining=50)
                    policy.observe(k, k, k // 2, 0.001 * k, 0.02)
            lat = prof.latencies(name)
            speedups(prof.survival(name, band), lat.expected(prof.reach(name, band)))
            prof.p_min(name, band)
            prof.catch_up_ms(name)
            if prof.overlap_latencies(name) is not None:
                profiling.overlap_speedups(prof, name, band)
    prof.split()
    bench.profile_latencies(prof, sorted(prof.data["drafters"]), (1, 1))


def check_and_use(data) -> bool:
    try:
        profiling.check_profile(data)
    except profiling.BadField as err:
        assert "\n" not in str(err)
        return False
    use_profile(profiling.Profile(data))
    return True


@FUZZ
@given(data=st.data(), base=st.sampled_from(sorted(GOOD_PROFILES)))
def test_fuzzed_profiles_are_refused_or_work(data, base):
    check_and_use(data.draw(mutated(GOOD_PROFILES[base]), label="profile"))


@SMALL
@given(data=st.dictionaries(st.text(max_size=8), toml_values(), max_size=6))
def test_arbitrary_tables_as_profiles_are_refused(data):
    assert not check_and_use(data) or data.get("schema") == profiling.SCHEMA


@SMALL
@given(data=st.data(), base=st.sampled_from(sorted(GOOD_PROFILES)))
def test_fuzzed_profile_files_load_with_a_warning_or_work_through_select_profile(tmp_path, data, base):
    from edgespec.runtime import RuntimeSpec, select_profile

    profile = data.draw(mutated(GOOD_PROFILES[base], n_max=2), label="profile")
    path = tmp_path / "p.toml"
    try:
        path.write_text(tomli_w.dumps(profile))
    except (TypeError, ValueError):  # a value TOML cannot write (a time with a zone): not a file a user can have
        return
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        for temperature in (0.0, 0.7):
            select_profile(RuntimeSpec(pair="smollm2-135m"), str(path), temperature)
    assert "Traceback" not in err.getvalue()
    assert all(line.startswith("edgespec: ") for line in err.getvalue().splitlines())


@SMALL
@given(raw=st.binary(max_size=300))
def test_profile_files_of_any_bytes_are_a_one_line_error(tmp_path, raw):
    path = tmp_path / "p.toml"
    path.write_bytes(raw)
    try:
        prof = profiling.read_profile(path)
    except EdgespecError as err:
        assert "\n" not in str(err)
    else:
        use_profile(prof)


def test_fuzz_inputs_are_not_all_refused(tmp_path):
    """The fuzzers' mutations leave some inputs valid, so what happens after the checks is fuzzed too."""
    assert check_and_use(copy.deepcopy(GOOD_PROFILES["sample"]))
    assert check_and_use(copy.deepcopy(GOOD_PROFILES["committed"]))
    for manifest in GOOD_MANIFESTS.values():
        assert parse_manifest(copy.deepcopy(manifest), tmp_path) is not None
