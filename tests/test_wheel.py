"""edgespec as a user installs it: a wheel built from this tree, installed into a fresh venv outside the repo.

The fresh venv sees the project's dependencies (torch and the rest) through a .pth file naming this
environment's site-packages as a plain path: Python appends such a path to sys.path without running that
directory's own .pth files, so the editable install of the checkout stays off and the only edgespec the fresh
venv can import is the wheel's. One build and install per module; each test runs a command from another folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv holding the wheel: its bin dir, an environment to run it in, and a folder outside the repo."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # a copy of what the wheel is built from: the build writes nothing into the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("edgespec", "tui"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
          "--disable-pip-version-check", "-q", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("edgespec-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    deps = sysconfig.get_paths()["purelib"]
    Path(purelib, "edgespec-test-deps.pth").write_text(deps + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
          "--disable-pip-version-check", str(wheel)])
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"EDGESPEC_CACHE": str(root / "cache"), "EDGESPEC_DATA": str(root / "data"), "HF_HUB_OFFLINE": "1",
            "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}
    return {"venv": venv, "env": env, "cwd": elsewhere, "root": root, "wheel": wheel}


def edgespec(installed, *args) -> subprocess.CompletedProcess:
    return _run([str(installed["venv"] / "bin" / "edgespec"), *args], cwd=installed["cwd"], env=installed["env"])


def test_the_wheel_carries_the_pairs_and_profiles_and_imports_from_the_venv(installed):
    import zipfile

    names = zipfile.ZipFile(installed["wheel"]).namelist()
    assert "edgespec/data/pairs/smollm2-135m.toml" in names
    assert len([n for n in names if n.startswith("edgespec/data/profiles/") and n.endswith(".toml")]) >= 8
    code = "import edgespec, tui, edgespec.models as m, edgespec.profiling as p; " \
           "print(edgespec.__file__); print(tui.__file__); print(m.list_pairs()); print(p.PROFILES_DIR)"
    out = _run([str(installed["venv"] / "bin" / "python"), "-c", code], cwd=installed["cwd"],
               env=installed["env"]).stdout.splitlines()
    venv = str(installed["venv"])
    assert all(line.startswith(venv) for line in (out[0], out[1], out[3])), out
    assert not any(str(REPO) in line for line in out)
    assert "smollm2-135m" in out[2] and "qwen2.5-coder-1.5b" in out[2]


def test_devices_runs_from_another_folder(installed):
    assert json.loads(edgespec(installed, "devices", "--json").stdout)["cores_logical"] >= 1


def test_generate_runs_the_tiny_models(installed, tiny_checkpoints):
    out = edgespec(installed, "generate", "--target", str(tiny_checkpoints["target"]), "--draft",
                   str(tiny_checkpoints["draft"]), "--target-backend", "torch", "--draft-backend", "torch",
                   "--k", "3", "--prompt", "hello", "--max-new-tokens", "8", "--json").stdout
    result = json.loads(out)
    assert len(result["token_ids"]) == 8 and result["metrics"]["num_drafts"] >= 1


def test_profile_show_lists_the_shipped_profiles_and_the_user_dir(installed):
    out = edgespec(installed, "profile", "--show").stdout
    shipped = Path(installed["venv"]).resolve()
    listed = [line for line in out.splitlines() if ".toml" in line and "[" in line]
    assert len(listed) >= 8 and all(line.startswith(str(shipped)) for line in listed), out
    assert str(Path(installed["env"]["EDGESPEC_DATA"]) / "profiles") in out


def test_models_lists_the_shipped_pairs(installed):
    out = edgespec(installed, "models").stdout
    assert str(Path(installed["venv"]).resolve()) in out.splitlines()[0]  # the pairs from the installed package
    assert "smollm2-135m" in out and "qwen2.5-coder-1.5b" in out and installed["env"]["EDGESPEC_CACHE"] in out
