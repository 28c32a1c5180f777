"""`edgespec models`: the known pairs, what edgespec downloaded and converted into its cache, and freeing it.

Only what edgespec wrote is ever deleted, and it knows what it wrote from its own records: a downloaded model
file's marker says it was downloaded (`origin`, `edgespec.models._write_marker`), and a conversion's manifest
(`edgespec-convert.json`, `edgespec.convert`) lists every file the conversion wrote. A file placed in the cache
by hand, a marker from before origins were recorded, or a file added to a conversion's folder later is listed
and left alone. Models named by hub id live in huggingface_hub's own cache, which `hf cache` manages.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EdgespecError


@dataclass
class Entry:
    """One thing in the cache: a downloaded model file, or one conversion's folder."""

    kind: str  # "download" | "conversion"
    name: str  # the file's or folder's name: what `--remove` takes besides a pair's name
    path: Path
    what: str  # e.g. "GGUF", "transformers float16", "onnx int4", "metadata (no weights)"
    pair: str | None = None  # the known pair it belongs to
    files: list[Path] = field(default_factory=list)  # what edgespec wrote (and may delete); empty: not ours
    note: str = ""  # why it is left alone

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.files if p.is_file()) if self.files else _size(self.path)


def entries() -> list[Entry]:
    """Everything edgespec's cache holds, each tied to its known pair where it has one."""
    from .convert import converted_dir
    from .paths import cache_dir

    pins = _pins()
    out = [_download(p, pins) for p in sorted((cache_dir() / "models").glob("*"))
           if p.is_file() and not p.name.endswith(".verified") and not p.name.startswith(".")]
    hf: dict[str, str | None] = {}  # a GGUF conversion's folder -> the pair its GGUF belongs to
    for kind in ("meta", "hf", "onnx"):
        for folder in sorted((converted_dir() / kind).glob("*")):
            if folder.is_dir() and not folder.name.startswith("."):
                entry = _conversion(folder, converted_dir() / "logs", pins, hf)
                hf[str(folder.resolve())] = entry.pair
                out.append(entry)
    return out


def _pins() -> dict[str, str]:
    """sha256 of every known pair's pinned model file -> the pair."""
    from .models import list_pairs, load_manifest

    out = {}
    for name in list_pairs():
        manifest = load_manifest(name)
        for spec in (manifest.target, manifest.draft):
            if spec is not None and spec.source.sha256:
                out[spec.source.sha256] = name
    return out


def _download(path: Path, pins: dict[str, str]) -> Entry:
    try:
        marker = json.loads(path.with_name(path.name + ".verified").read_text())
    except (OSError, ValueError):
        marker = None
    pair = pins.get(marker.get("sha256")) if isinstance(marker, dict) else None
    entry = Entry("download", path.name, path, "GGUF" if path.suffix == ".gguf" else "model file", pair)
    if isinstance(marker, dict) and marker.get("origin") == "downloaded":
        entry.files = [path, path.with_name(path.name + ".verified")]
    elif isinstance(marker, dict) and marker.get("origin") == "placed":
        entry.note = "placed by hand: left alone"
    else:
        entry.note = "not recorded as downloaded by edgespec: left alone (delete it by hand if you want)"
    return entry


def _conversion(folder: Path, logs: Path, pins: dict[str, str], hf: dict[str, str | None]) -> Entry:
    from .convert import MANIFEST

    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict):
        return Entry("conversion", folder.name, folder, "unfinished", None,
                     note=f"no {MANIFEST}: not a finished conversion, left alone")
    if manifest.get("kind") == "hf":
        what, pair = f"transformers {manifest.get('dtype', '')}".strip(), pins.get(manifest.get("source_sha256"))
    elif manifest.get("kind") == "meta":  # a GGUF's tokenizer and config, for llama.cpp (`convert.gguf_meta`)
        what, pair = "metadata (no weights)", pins.get(manifest.get("source_sha256"))
    else:
        what = f"onnx {manifest.get('precision', '')}".strip()
        pair = hf.get(str(Path(manifest.get("source", "")).resolve())) if manifest.get("source") else None
    entry = Entry("conversion", folder.name, folder, what, pair)
    recorded = manifest.get("files")
    if not isinstance(recorded, dict):
        entry.note = "its manifest predates file records: left alone (the next start that uses it records them)"
        return entry
    entry.files = [folder / rel for rel in recorded] + [folder / MANIFEST]
    log = logs / f"{folder.name}.log"
    if log.is_file():
        entry.files.append(log)
    return entry


def remove(entry: Entry) -> tuple[int, list[Path]]:
    """Delete what edgespec wrote of `entry`: bytes freed, and what was left because edgespec did not write it."""
    freed = 0
    for path in entry.files:
        try:
            size = path.stat().st_size
            path.unlink()
            freed += size
        except FileNotFoundError:
            continue
    left = []
    if entry.kind == "conversion" and entry.path.is_dir():
        for root, dirs, files in os.walk(entry.path, topdown=False):
            left += [Path(root) / f for f in files]
            if not os.listdir(root):
                os.rmdir(root)
    return freed, left


def leftovers() -> list[Path]:
    """What interrupted downloads and conversions of processes that no longer run left behind (named with their
    pid, as `edgespec.models` and `edgespec.convert` name them), and the digest memo: edgespec's to delete."""
    from .convert import converted_dir
    from .paths import cache_dir, pid_alive

    def dead(name: str) -> bool:
        if ".partial-" in name:  # a conversion's staging folder: .{final}.partial-{pid}
            pid = name.rsplit("-", 1)[-1]
        else:  # a download's folder {final}.{pid}-xxxx, or its partial file .{final}.{pid}-xxxx.partial
            pid = name.removesuffix(".partial").rsplit(".", 1)[-1].split("-", 1)[0]
        return pid.isdigit() and not pid_alive(int(pid))

    found = [p for p in (cache_dir() / "downloads").glob("*") if p.is_dir() and dead(p.name)]
    found += [p for p in (cache_dir() / "models").glob(".*.partial") if dead(p.name)]
    found += [p for kind in ("meta", "hf", "onnx") for p in (converted_dir() / kind).glob(".*.partial-*")
              if dead(p.name)]
    memo = converted_dir() / "digests.json"
    return found + ([memo] if memo.is_file() else [])


def remove_path(path: Path) -> int:
    """Delete a leftover file or folder (`leftovers`); the bytes freed."""
    import shutil

    size = _size(path) if path.exists() else 0
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return size


def select(name: str, found: list[Entry]) -> list[Entry]:
    """The entries `--remove NAME` means: a known pair's (everything tied to it), or one entry by its name."""
    from .models import list_pairs

    chosen = [e for e in found if e.pair == name] if name in list_pairs() else [e for e in found if e.name == name]
    if not chosen and name not in list_pairs():
        names = sorted({e.pair for e in found if e.pair} | {e.name for e in found})
        raise EdgespecError(f"nothing in the cache is called {name!r}; `edgespec models` lists what is there"
                            + (f" ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})" if names else ""))
    return chosen


def listing(found: list[Entry]) -> str:
    """`edgespec models`: each known pair with what of it is here, then every cache entry with its size."""
    from .models import MODELS_DIR, list_pairs, load_manifest
    from .paths import cache_dir

    lines = [f"known pairs ({MODELS_DIR}):"]
    for name in list_pairs():
        m = load_manifest(name)
        mine = [e for e in found if e.pair == name]
        here = (f"{sum(e.kind == 'download' for e in mine)} downloaded, {sum(e.kind == 'conversion' for e in mine)} "
                f"converted, {human(sum(e.size for e in mine))}") if mine else \
            f"nothing here yet ({human(sum(s.source.size or 0 for s in (m.target, m.draft) if s))} to download)"
        lines.append(f"  {name:20} {here}  · {m.description}")
    lines.append(f"cache: {cache_dir()} (EDGESPEC_CACHE moves it)")
    for e in found:
        owner = e.pair or ("your model" if e.kind == "conversion" else "no known pair")
        lines.append(f"  {human(e.size):>9}  {owner:20} {e.kind:10} {e.what:22} {e.name}" + (f"  [{e.note}]" if e.note else ""))
    if not found:
        lines.append("  empty")
    total = sum(e.size for e in found)
    lines.append(f"total {human(total)}; `edgespec models --remove NAME` frees a pair's files (or one entry's), "
                 "`--clean` all edgespec wrote")
    lines.append(f"models named by hub id (--target org/name) stay in the Hugging Face cache ({_hub_cache()}): "
                 "`hf cache ls` lists it, `hf cache rm` frees it")
    return "\n".join(lines)


def human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
