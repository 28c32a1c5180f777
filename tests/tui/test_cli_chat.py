"""`edgespec chat` from the command line: bad options and a failing start-up end with exit status 2."""

from __future__ import annotations

import sys
import types

import pytest

import tui.app
from edgespec.cli import main
from edgespec.errors import EdgespecError


@pytest.mark.parametrize("argv,message", [
    (["--k", "17"], "out of range"), (["--k", "x"], "neither 'auto'"), (["--top-p", "2"], "top-p"),
    (["--temperature", "-0.5"], "temperature"), (["--max-new-tokens", "0"], "max new tokens"),
])
def test_bad_options_are_one_line_errors(argv, message, capsys):
    assert main(["chat", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgespec: error: ") and message in err and "Traceback" not in err


def test_a_failing_build_session_exits_2_with_the_message(monkeypatch, capfd):
    def build_session(args, progress):
        progress("resolving pair")
        assert args.k == "auto" and args.system is None and hasattr(args, "target_device")
        raise EdgespecError("cannot download SmolLM2: no network; pass --target DIR")

    monkeypatch.setitem(sys.modules, "edgespec.runtime", types.SimpleNamespace(build_session=build_session))

    class Headless(tui.app.ChatApp):
        def run(self, **kwargs):
            return super().run(headless=True, **kwargs)

    monkeypatch.setattr(tui.app, "ChatApp", Headless)
    assert main(["chat"]) == 2
    err = capfd.readouterr().err
    assert "edgespec: error: cannot download SmolLM2: no network; pass --target DIR" in err
    assert "Traceback" not in err
