"""README stays short and true: its code compiles (and, on a GPU, its quickstart runs as pasted),
and its test command is the one CI runs. Its links: tests/test_docs_links.py; its figures:
tests/test_report.py."""
from __future__ import annotations

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
    assert n <= 200, f"README.md has {n} lines; the long material belongs in docs/"


def test_readme_test_command_is_what_ci_runs():
    # .ci/run runs README's second command verbatim; the two must not drift apart.
    commands = [line.split("  #")[0].strip() for line in _blocks("bash")[0].splitlines() if line.strip()]
    assert len(commands) >= 2, commands
    ci = [line.strip() for line in _read(os.path.join(ROOT, ".ci", "run")).splitlines()
          if line.startswith("pip install")]
    assert ci == [commands[1]]


@pytest.mark.gpu
def test_readme_quickstart_runs(capsys):
    pytest.importorskip("transformers")
    src = _blocks("python")[0]
    exec(compile(src, "README quickstart", "exec"), {"__name__": "__readme__"})
    assert "resident" in capsys.readouterr().out   # handle.plan was printed
