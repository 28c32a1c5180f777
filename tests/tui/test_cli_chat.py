"""`edgespec chat` from the command line: bad options and a failing start-up end with exit status 2."""

from __future__ import annotations

import pytest

import edgespec.api
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


def test_a_failing_load_exits_2_with_the_message(monkeypatch, capfd):
    def load_spec(spec, *, k, temperature, p_min, profile, progress):
        progress("resolving pair")
        assert k == "auto" and temperature == 0.0 and spec.target_device == "auto" and spec.pair is None
        raise EdgespecError("cannot download SmolLM2: no network; pass --target DIR")

    monkeypatch.setattr(edgespec.api, "load_spec", load_spec)

    class Headless(tui.app.ChatApp):
        def run(self, **kwargs):
            return super().run(headless=True, **kwargs)

    monkeypatch.setattr(tui.app, "ChatApp", Headless)
    assert main(["chat"]) == 2
    err = capfd.readouterr().err
    assert "edgespec: error: cannot download SmolLM2: no network; pass --target DIR" in err
    assert "Traceback" not in err


def test_a_model_without_a_chat_template_cannot_start_the_chat(untemplated_target, monkeypatch, capfd):
    """The check runs once the model is loaded (`Model.has_chat_template`), not at the first turn."""

    class Headless(tui.app.ChatApp):
        def run(self, **kwargs):
            return super().run(headless=True, **kwargs)

    monkeypatch.setattr(tui.app, "ChatApp", Headless)
    assert main(["chat", "--target", str(untemplated_target), "--target-backend", "torch", "--draft", "none"]) == 2
    err = " ".join(capfd.readouterr().err.split())  # the app's exit message wraps at the terminal's width
    name = untemplated_target.name
    assert f"edgespec: error: {name}'s tokenizer has no chat template; edgespec chat needs an instruct/chat model" in err
    assert "Traceback" not in err
