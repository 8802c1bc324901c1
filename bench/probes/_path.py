"""Lets a probe run as ``python bench/probes/probe_x.py`` from a checkout without installing: puts
bench/ (for _common) and the repository root (for tiermem) on sys.path. Import it first."""
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(BENCH, "results")   # the probes' results sit beside the benches'
for _p in (os.path.dirname(BENCH), BENCH):
    if _p not in sys.path:
        sys.path.insert(0, _p)
