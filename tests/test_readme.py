"""README stays short and true: its code compiles (and, on a GPU, its quickstart runs as pasted),
its test command is the one CI runs, and every file the docs link to exists."""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", _read(README), re.S | re.M)


def test_readme_python_blocks_compile():
    blocks = _blocks("python")
    assert blocks, "README has no python code block"
    for i, src in enumerate(blocks):
        compile(src, f"README python block {i + 1}", "exec")


def test_readme_is_short():
    n = len(_read(README).splitlines())
    assert n < 250, f"README.md has {n} lines; the long material belongs in docs/"


def test_readme_test_command_is_what_ci_runs():
    # .ci/run runs README's second command verbatim; the two must not drift apart.
    commands = [line.split("  #")[0].strip() for line in _blocks("bash")[0].splitlines() if line.strip()]
    assert len(commands) >= 2, commands
    ci = [line.strip() for line in _read(os.path.join(ROOT, ".ci", "run")).splitlines()
          if line.startswith("pip install")]
    assert ci == [commands[1]]


def _doc_pages() -> list[str]:
    return [README, *glob.glob(os.path.join(ROOT, "docs", "*.md")), *glob.glob(os.path.join(ROOT, "bench", "*", "README.md"))]


@pytest.mark.parametrize("page", _doc_pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_doc_links_point_at_files(page):
    """Result files get pruned; a page must not keep linking to one that is gone."""
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _read(page)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
        if not os.path.exists(path):
            missing.append(target)
    assert not missing, f"{os.path.relpath(page, ROOT)} links to missing files: {missing}"


@pytest.mark.gpu
def test_readme_quickstart_runs(capsys):
    pytest.importorskip("transformers")
    src = _blocks("python")[0]
    exec(compile(src, "README quickstart", "exec"), {"__name__": "__readme__"})
    assert "resident" in capsys.readouterr().out   # handle.plan was printed
