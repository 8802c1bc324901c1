"""NOTE [slow cases]: the record of each case's time, and which cases it moves out of the default
run. No GPU."""
from __future__ import annotations

import conftest
import durations
import helpers


class _Item:
    def __init__(self, nodeid: str, gpu: bool = False):
        self.nodeid = nodeid
        self.gpu = gpu

    def get_closest_marker(self, name: str):
        return object() if (name == "gpu" and self.gpu) else None


def test_a_durations_report_sums_each_cases_phases():
    report = """============================= slowest durations =============================
13.16s call     tests/test_a.py::test_x[never bites]
0.50s setup    tests/test_a.py::test_x[never bites]
2.00s call     tests/test_b.py::test_y
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""
    assert durations.parse(report) == {"tests/test_a.py::test_x[never bites]": 13.66, "tests/test_b.py::test_y": 2.0}


def test_slow_cases_leave_each_files_fastest_and_the_unrecorded(monkeypatch):
    slow = helpers.SLOW_S + 1
    monkeypatch.setattr(durations, "load", lambda: {
        "tests/test_a.py::one": slow, "tests/test_a.py::two": slow + 1, "tests/test_a.py::three": 0.1,
        "tests/test_b.py::only": slow + 5, "tests/test_b.py::other": slow + 6, "tests/test_gpu_c.py::g": slow})
    items = [_Item("tests/test_a.py::one"), _Item("tests/test_a.py::two"), _Item("tests/test_a.py::three"),
             _Item("tests/test_b.py::only"), _Item("tests/test_b.py::other"), _Item("tests/test_b.py::new"),
             _Item("tests/test_gpu_c.py::g", gpu=True)]
    # test_a keeps its fast case, test_b its fastest recorded one; a case with no record, and a GPU
    # case, stay where they are
    assert conftest.slow_cases(items) == {"tests/test_a.py::one", "tests/test_a.py::two", "tests/test_b.py::other"}
