"""Sanity checks for the Spec-Bench-like prompt set shipped in edgespec/data/bench_prompts.jsonl."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest

PROMPTS = Path(__file__).resolve().parent.parent / "edgespec" / "data" / "bench_prompts.jsonl"

CATEGORIES = {"multi_turn", "translation", "summarization", "qa", "math", "rag", "code", "rewrite"}
PASSAGE_CATEGORIES = {"rag", "rewrite", "summarization"}
ROLES = {"system", "user", "assistant"}
MIN_PER_CATEGORY = 6
QUICK_PER_CATEGORY = 2
MIN_PASSAGE_WORDS = 80
MAX_PROMPT_WORDS = 350  # small models: keep each prompt well inside a short context


def _load():
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()
    records = []
    for lineno, line in enumerate(lines, 1):
        assert line.strip(), f"blank line {lineno} in {PROMPTS.name}"
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:  # pragma: no cover - reported as a failure
            pytest.fail(f"line {lineno} is not valid JSON: {e}")
    return records


@pytest.fixture(scope="module")
def prompts():
    assert PROMPTS.is_file(), f"missing {PROMPTS}"
    return _load()


def _words(text):
    return len(text.split())


def test_every_line_parses_with_expected_keys(prompts):
    assert prompts
    for p in prompts:
        assert set(p) == {"id", "category", "messages", "quick"}, p.get("id")
        assert isinstance(p["id"], str) and p["id"]
        assert isinstance(p["quick"], bool), p["id"]
        assert isinstance(p["messages"], list) and p["messages"], p["id"]


def test_ids_unique_and_named_after_category(prompts):
    ids = [p["id"] for p in prompts]
    dupes = [i for i, n in Counter(ids).items() if n > 1]
    assert not dupes, f"duplicate ids: {dupes}"
    for p in prompts:
        assert re.fullmatch(rf"{re.escape(p['category'])}-\d{{2}}", p["id"]), p["id"]


def test_categories_counts_and_quick(prompts):
    cats = Counter(p["category"] for p in prompts)
    assert set(cats) == CATEGORIES, f"unexpected categories: {set(cats) ^ CATEGORIES}"
    for cat in CATEGORIES:
        assert cats[cat] >= MIN_PER_CATEGORY, f"{cat}: only {cats[cat]} prompts"
        quick = [p["id"] for p in prompts if p["category"] == cat and p["quick"]]
        assert len(quick) == QUICK_PER_CATEGORY, f"{cat}: quick prompts {quick}"


def test_roles_valid_and_content_non_empty(prompts):
    for p in prompts:
        for m in p["messages"]:
            assert set(m) == {"role", "content"}, p["id"]
            assert m["role"] in ROLES, (p["id"], m["role"])
            assert isinstance(m["content"], str) and m["content"].strip(), p["id"]


def test_messages_alternate_and_end_with_user(prompts):
    for p in prompts:
        roles = [m["role"] for m in p["messages"]]
        if roles[0] == "system":
            roles = roles[1:]
        assert "system" not in roles, f"{p['id']}: system message only allowed first"
        assert roles, f"{p['id']}: no conversation after the system message"
        assert roles[0] == "user", f"{p['id']}: conversation must start with the user"
        assert roles[-1] == "user", f"{p['id']}: must end with a user message"
        for a, b in zip(roles, roles[1:]):
            assert a != b, f"{p['id']}: two {a} messages in a row"


def test_multi_turn_has_earlier_turns(prompts):
    for p in prompts:
        turns = [m for m in p["messages"] if m["role"] != "system"]
        if p["category"] == "multi_turn":
            assert 5 <= len(turns) <= 7, f"{p['id']}: want 2-3 earlier exchanges, got {len(turns)} messages"
        else:
            assert len(turns) == 1, f"{p['id']}: single-turn categories have one user message"


def test_passage_categories_contain_a_passage(prompts):
    for p in prompts:
        if p["category"] not in PASSAGE_CATEGORIES:
            continue
        paragraphs = [
            para for m in p["messages"] if m["role"] == "user" for para in re.split(r"\n\s*\n", m["content"])
        ]
        longest = max(_words(para) for para in paragraphs)
        assert longest >= MIN_PASSAGE_WORDS, f"{p['id']}: longest passage has {longest} words"


def test_prompts_are_short_enough_for_small_models(prompts):
    for p in prompts:
        total = sum(_words(m["content"]) for m in p["messages"])
        assert total <= MAX_PROMPT_WORDS, f"{p['id']}: {total} words"


def test_quick_prompts_are_among_the_shorter_ones(prompts):
    """`bench --quick` should be cheap: each quick prompt is no longer than its category's median."""
    for cat in CATEGORIES:
        sizes = sorted(sum(_words(m["content"]) for m in p["messages"]) for p in prompts if p["category"] == cat)
        median = sizes[len(sizes) // 2]
        for p in prompts:
            if p["category"] == cat and p["quick"]:
                size = sum(_words(m["content"]) for m in p["messages"])
                assert size <= median, f"{p['id']}: {size} words > {cat} median {median}"
