"""The measured time of each CPU test case (NOTE [slow cases] in tests/helpers.py), kept in
tests/durations.json: read by tests/conftest.py, written from a run's ``--durations=0`` report.

    python -m pytest -q -n auto --dist loadgroup --durations=0 > run.log
    python tests/durations.py run.log          # rewrites tests/durations.json

Cases the run did not report (under 5 ms, or not selected) keep their recorded time."""
from __future__ import annotations

import json
import os
import re
import sys

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
_LINE = re.compile(r"^\s*([\d.]+)s (?:call|setup|teardown)\s+(tests/\S.*?)\s*$")


def load(path: str = PATH) -> dict[str, float]:
    """Seconds per node id (setup, call and teardown together); empty where there is no record."""
    try:
        with open(path, encoding="utf-8") as f:
            return {str(k): float(v) for k, v in json.load(f).items()}
    except FileNotFoundError:
        return {}


def parse(report: str) -> dict[str, float]:
    """Seconds per node id from pytest's ``--durations=0`` lines."""
    out: dict[str, float] = {}
    for line in report.splitlines():
        m = _LINE.match(line)
        if m:
            out[m.group(2)] = round(out.get(m.group(2), 0.0) + float(m.group(1)), 2)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    with open(argv[0], encoding="utf-8", errors="replace") as f:
        new = parse(f.read())
    if not new:
        print(f"{argv[0]} holds no --durations=0 lines", file=sys.stderr)
        return 1
    merged = {**load(), **new}
    with open(PATH, "w", encoding="utf-8") as f:
        json.dump(dict(sorted(merged.items())), f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"{len(new)} cases measured, {len(merged)} recorded in {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
