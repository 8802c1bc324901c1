"""The step clock (NOTE [step time model]) on the host clock, as it runs where there is no CUDA."""
from __future__ import annotations

import time

import pytest

from tiermem._steptime import StepClock


def test_stalls_are_taken_out_of_compute_and_only_between_the_marks_asked():
    c = StepClock(cuda=False)
    a = c.mark()
    time.sleep(0.02)                       # "compute"
    c.stall(lambda: time.sleep(0.05))      # a wait for a copy
    m = c.mark()
    time.sleep(0.02)
    b = c.mark()
    assert c.between(a, b) == pytest.approx(0.09, abs=0.02)
    assert c.compute(a, b) == pytest.approx(0.04, abs=0.02)
    assert c.compute(m, b) == pytest.approx(0.02, abs=0.015)     # the stall lies before m
    assert c.ready() and len(c.times()) == 5
    c.reset()
    assert c.times() == []
