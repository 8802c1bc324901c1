"""README's figures are bench/report.py's table of the committed JSONs, and nothing else: the test
fails when a figure in README.md and the JSON it cites disagree. No GPU."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _block(text: str) -> str:
    return text[text.index(report.BEGIN) + len(report.BEGIN): text.index(report.END)]


def test_readme_figures_are_the_jsons():
    diff = report.check()
    assert not diff, "README.md's figures differ from bench/results (run python bench/report.py):\n" + "\n".join(diff)


def test_each_cell_is_short_and_each_row_links_a_committed_json():
    with open(report.README, encoding="utf-8") as f:
        rows = [r for r in _block(f.read()).strip().splitlines()[2:]]
    required = [r for r in report.ROWS if not r.optional]
    assert len(required) <= len(rows) <= len(report.ROWS)
    for r in rows:
        cells = [c.strip() for c in r.strip().strip("|").split(" | ")]
        assert len(cells) == 4, r
        assert all(len(c) < report.CELL_MAX for c in cells), r
        links = re.findall(r"\]\(([^)]+)\)", cells[3])
        assert len(links) == 1 and links[0].startswith("bench/results/") and links[0].endswith(".json"), r
        path = os.path.join(ROOT, links[0])
        with open(path) as f:
            d = json.load(f)
        assert {"bench", "device", "commit", "date", "metrics", "checks"} <= set(d), path
        # the row names its metrics, and each is in the JSON it links
        for name in re.findall(r"`([^`]+)`", cells[2]):
            assert name in d["metrics"] or name in d["checks"], (name, path)


def _result(tmp, name, bench, device, date, metrics, checks=None):
    d = {"bench": bench, "device": device, "commit": "abc1234", "date": date, "metrics": metrics,
         "checks": checks or {}, "raw": {}}
    p = tmp / name
    p.write_text(json.dumps(d))
    return str(p), d


def test_the_latest_result_holding_the_rows_figures_is_picked(tmp_path):
    row = report.Row("x", "bandwidth", "{a:.2f} and {ok=c}", device="H100")
    older = _result(tmp_path, "1.json", "bandwidth", "NVIDIA H100 80GB HBM3", "2026-11-20T10:00:00",
                    {"a": 1.0}, {"c": True})
    newer = _result(tmp_path, "2.json", "bandwidth", "NVIDIA H100 80GB HBM3", "2026-11-22T10:00:00",
                    {"a": 2.0}, {"c": False})
    lacking = _result(tmp_path, "3.json", "bandwidth", "NVIDIA H100 80GB HBM3", "2026-11-23T10:00:00", {"b": 3.0})
    other_device = _result(tmp_path, "4.json", "bandwidth", "NVIDIA H200", "2026-11-24T10:00:00",
                           {"a": 4.0}, {"c": True})
    other_bench = _result(tmp_path, "5.json", "soak", "NVIDIA H100 80GB HBM3", "2026-11-25T10:00:00",
                          {"a": 5.0}, {"c": True})
    results = [older, newer, lacking, other_device, other_bench]
    path, d = report.pick(row, results)
    assert path == newer[0]
    assert report._Fields(d).format(row.figure) == "2.00 and NO"
    assert report.pick(dataclasses.replace(row, device="H200"), results)[0] == other_device[0]
    # a row that asks for at least so much of a metric skips the results with less
    assert report.pick(dataclasses.replace(row, least=(("a", 1.5),)), results[:3])[0] == newer[0]
    assert report.pick(dataclasses.replace(row, least=(("a", 0.5),)), [older, lacking])[0] == older[0]
    with pytest.raises(LookupError):
        report.pick(dataclasses.replace(row, least=(("a", 3.0),)), results[:3])
    with pytest.raises(LookupError, match="holds missing"):
        report.pick(report.Row("x", "bandwidth", "{missing}"), results)
    assert report.load(str(tmp_path))      # the loader reads them too
    (tmp_path / "probe.json").write_text(json.dumps({"device": "H100", "runs": {}}))   # a probe's: not a bench's
    assert all(p.endswith(("1.json", "2.json", "3.json", "4.json", "5.json")) for p, _ in report.load(str(tmp_path)))


def test_a_figure_that_drifts_from_its_json_fails_the_check(tmp_path, monkeypatch):
    with open(report.README, encoding="utf-8") as f:
        text = f.read()
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert report.check(str(readme)) == []
    block = _block(text)
    m = re.search(r"\*\*(\d+\.\d+)", block)
    drifted = block.replace(m.group(0), "**" + str(round(float(m.group(1)) + 0.01, 2)), 1)
    readme.write_text(text.replace(block, drifted))
    diff = report.check(str(readme))
    assert diff and any(line.startswith("-") and "**" in line for line in diff)
    monkeypatch.setattr(report, "README", str(readme))
    assert report.main(["--check"]) == 1
    assert report.main([]) == 0                     # writing the table back makes it agree again
    assert report.main(["--check"]) == 0
    assert readme.read_text() == text


def test_an_optional_row_waits_for_a_result_and_a_required_one_does_not(tmp_path, monkeypatch):
    results = [_result(tmp_path, "1.json", "soak", "NVIDIA H100", "2026-11-20T10:00:00", {"a": 1.0})]
    shown = report.Row("shown", "soak", "{a:.1f}")
    later = report.Row("later", "soak", "{b:.1f}", optional=True)
    monkeypatch.setattr(report, "ROWS", (shown, later))
    text = report.table(results, str(tmp_path))
    assert "| shown | 1.0 |" in text and "later" not in text
    results.append(_result(tmp_path, "2.json", "soak", "NVIDIA H100", "2026-11-21T10:00:00", {"a": 2.0, "b": 3.0}))
    assert "| later | 3.0 |" in report.table(results, str(tmp_path))
    monkeypatch.setattr(report, "ROWS", (report.Row("needed", "soak", "{c}"),))
    with pytest.raises(LookupError):
        report.table(results, str(tmp_path))


def test_a_long_cell_is_refused(tmp_path):
    results = [_result(tmp_path, "1.json", "soak", "NVIDIA H100", "2026-11-20T10:00:00", {"a": 1.0})]
    long_row = report.Row("x" * 250, "soak", "{a}")
    old = report.ROWS
    try:
        report.ROWS = (long_row,)
        with pytest.raises(ValueError, match="characters"):
            report.table(results, str(tmp_path))
    finally:
        report.ROWS = old
