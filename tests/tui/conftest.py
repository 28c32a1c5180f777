"""Every TUI test keeps its chats and remembered speeds in a temp dir (EDGESPEC_DATA)."""

import pytest


@pytest.fixture(autouse=True)
def data_dir_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_DATA", str(tmp_path / "data"))
    return tmp_path / "data"
