"""A drafter that fails mid-answer: the answer finishes on the target alone and the user is told once, on
stderr for `generate`, in `notices` of `--json` (and in the metrics)."""

import json

from edgespec.cli import main
from edgespec.drafters import ModelDrafter

TORCH = ["--target-backend", "torch", "--draft-backend", "torch"]


def test_generate_tells_the_user_once_that_speculation_stopped(tiny_checkpoints, capsys, monkeypatch):
    t, d = str(tiny_checkpoints["target"]), str(tiny_checkpoints["draft"])
    base = ["generate", *TORCH, "--target", t, "--prompt", "hello world", "--max-new-tokens", "24", "--k", "3"]
    assert main([*base, "--draft", "none", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)

    calls, original = [], ModelDrafter.commit

    def broken_commit(self, n_accepted, next_token):  # the second round's commit fails
        calls.append(n_accepted)
        if len(calls) == 2:
            raise RuntimeError("draft cache out of step")
        original(self, n_accepted, next_token)

    monkeypatch.setattr(ModelDrafter, "commit", broken_commit)

    assert main([*base, "--draft", d, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == alone["token_ids"]  # the target alone finished it, token for token
    assert len(result["notices"]) == 1 and "draft cache out of step" in result["notices"][0]
    assert result["metrics"]["notices"] == result["notices"]
    assert result["metrics"]["k_per_round"][2:] == [0] * (len(result["metrics"]["k_per_round"]) - 2)

    calls.clear()
    assert main([*base, "--draft", d]) == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if "drafter failed" in line]
    assert len(lines) == 1 and "draft cache out of step" in lines[0] and "target alone" in lines[0]
