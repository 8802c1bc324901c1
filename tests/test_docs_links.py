"""Every relative link in README.md, docs/*.md and the bench folders' READMEs resolves to a file of
the repository, and a link to a heading (#...) to a heading of that page: result files get pruned
and sections renamed, and a page must not keep pointing at what is gone. No GPU."""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md")),
                *glob.glob(os.path.join(ROOT, "bench", "*", "README.md"))])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped,
    spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", _read(path), flags=re.S | re.M)     # no headings inside code
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def test_the_slug_is_githubs():
    assert _slug("Whole-step graphs (`train.graphed`)") == "whole-step-graphs-traingraphed"
    assert _slug("Loading a checkpoint") == "loading-a-checkpoint"
    assert _slug("What the model cannot price on replays, and a slot for recompute") == \
        "what-the-model-cannot-price-on-replays-and-a-slot-for-recompute"


def test_every_page_is_found():
    assert os.path.join(ROOT, "README.md") in PAGES and any(p.endswith("training.md") for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(page):
    bad = []
    for target in LINK.findall(_read(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):        # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
        if os.path.relpath(path, ROOT).startswith(".."):
            bad.append(f"{target} (outside the repository)")
        elif not os.path.exists(path):
            bad.append(f"{target} (no such file)")
        elif anchor and path.endswith(".md") and anchor not in _anchors(path):
            bad.append(f"{target} (no such heading)")
    assert not bad, f"{os.path.relpath(page, ROOT)} links to what is not there: {bad}"
