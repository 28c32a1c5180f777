"""Where edgespec keeps files outside the repository (and outside the installed package).

Converted and downloaded models live in the user cache dir, profiles measured here and chat history in the user
data dir, as platformdirs places them (on Linux `$XDG_CACHE_HOME/edgespec`, default ~/.cache/edgespec, and
`$XDG_DATA_HOME/edgespec`, default ~/.local/share/edgespec). `EDGESPEC_CACHE` and `EDGESPEC_DATA` override
them (tests point them at temp dirs; CI keeps a cache between test runs). Models named by hub id stay in
huggingface_hub's cache (`HF_HOME`, `HF_HUB_CACHE`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path



def cache_dir() -> Path:
    """The root of edgespec's cache; created on first use."""
    import platformdirs  # late: a bare environment (the GPU script's) only needs it when no override is set

    return _made("EDGESPEC_CACHE", "cache", lambda: platformdirs.user_cache_dir("edgespec"))


def user_path(text: str | Path, what: str) -> Path:
    """A path the user gave, `~` and `~user` expanded; a one-line EdgespecError for a `~user` this machine does
    not know (pathlib raises RuntimeError there)."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        from .errors import EdgespecError

        raise EdgespecError(f"{what} {str(text)!r} starts with a ~user this machine does not know; "
                            "give the full path") from None


def pid_alive(pid: int) -> bool:
    """Is process `pid` running (a leftover named with it belongs to a live conversion or download)?"""
    if pid == os.getpid():
        return False  # a leftover with our own pid is from an earlier process that had the same id
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or not a pid this system can have
        return False
    except OSError:  # PermissionError: it runs, as another user
        return True
    return True


def data_dir() -> Path:
    """The user data dir (chat history and the like); `EDGESPEC_DATA` overrides it."""
    import platformdirs

    return _made("EDGESPEC_DATA", "data", lambda: platformdirs.user_data_dir("edgespec"))


def _made(env: str, what: str, default: Callable[[], str]) -> Path:
    """The folder `$env` names, or `default()` (asked only without it), created; a one-line EdgespecError where it
    cannot be (a file of that name, no permission, a read-only disk)."""
    override = os.environ.get(env)
    root = user_path(override, env) if override else Path(default())
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        from .errors import EdgespecError

        why = "a file is in its way" if root.exists() and not root.is_dir() else err.strerror
        fix = f"point {env} at a folder you can write" if override else f"make it writable or set {env}"
        raise EdgespecError(f"cannot use {root} as edgespec's {what} folder ({why}); {fix}") from None
    return root
