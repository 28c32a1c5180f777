"""Every relative link in README.md and docs/*.md points at a file or folder that exists in the checkout."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    found = [m.group(1) or m.group(2) for m in LINK.finditer(text)]
    return [t for t in found if not t.startswith(("http://", "https://", "mailto:", "#"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    missing = [t for t in relative_links(page) if not (page.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_the_checker_sees_links_and_would_catch_a_broken_one(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](x.md) [b](https://example.org) [c](#top)\n```\n[d](in-code.md)\n```\n", encoding="utf-8")
    assert relative_links(page) == ["x.md"]
    assert len(relative_links(ROOT / "README.md")) >= 3
