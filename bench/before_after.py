"""Compare two runs of the benches, before and after a change, measured one after the other on one
machine: every metric each bench printed, its ratio, and how many stayed within a tolerance.

    python bench/before_after.py FOLDER --tolerance 0.03

FOLDER (a scratch folder: its logs are inputs, not results) holds ``<bench>-before.log`` and ``<bench>-after.log`` pairs, as the benches print them
(the metric table: a name and a number per line). Metrics are split into those that run through
tiermem and the baselines beside them (resident, accelerate, FSDP2, save_on_cpu, torch's
checkpointing, plain managed memory): a baseline runs no tiermem code, so how far it moves between
the two runs is the spread of the machine itself, which the tiermem figures are read against.
Writes ``bench/results/before_after-<device>-<date>.json``."""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, device_slug, provenance, table  # noqa: E402

LINE = re.compile(r"^([A-Za-z_][\w.\-/]*)\s+(-?\d+(?:\.\d+)?(?:e-?\d+)?)\s*$")
# Figures that run no tiermem code: the machine's own spread between the two runs.
BASELINE = re.compile(r"(^|_)(resident|accelerate|fsdp|save_on_cpu|checkpoint|um_prefetch|um_fault|pinned_|link_)")
# Figures that are sizes, counts or settings, not measurements.
FIXED = re.compile(r"(bytes|params|_GB$|architectures|max_batch|margin|floor|footprint|over_budget)")


def metrics(path: str) -> dict[str, float]:
    out = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line.rstrip())
            if m:
                out[m.group(1)] = float(m.group(2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--tolerance", type=float, default=0.03)
    a = ap.parse_args()
    out_metrics: dict[str, float] = {}
    checks: dict[str, bool] = {}
    raw: dict = {}
    rows = []
    for before in sorted(glob.glob(os.path.join(a.folder, "*-before.log"))):
        bench = os.path.basename(before)[: -len("-before.log")]
        after = before.replace("-before.log", "-after.log")
        b, f = metrics(before), metrics(after)
        kinds: dict[str, list[float]] = {"tiermem": [], "baseline": []}
        for k in b:
            if k not in f or not b[k] or FIXED.search(k):
                continue
            change = f[k] / b[k] - 1
            kind = "baseline" if BASELINE.search(k) else "tiermem"
            kinds[kind].append(abs(change))
            raw[f"{bench}.{k}"] = {"before": b[k], "after": f[k], "change": round(change, 4), "kind": kind}
        for kind, ch in kinds.items():
            if not ch:
                continue
            within = sum(c <= a.tolerance for c in ch)
            out_metrics[f"{bench}.{kind}.figures"] = len(ch)
            out_metrics[f"{bench}.{kind}.within"] = within
            out_metrics[f"{bench}.{kind}.median_abs_change"] = round(statistics.median(ch), 4)
            out_metrics[f"{bench}.{kind}.max_abs_change"] = round(max(ch), 4)
            rows.append((bench, kind, len(ch), within, f"{statistics.median(ch):.1%}", f"{max(ch):.1%}"))
        if kinds["tiermem"]:
            checks[f"{bench}_tiermem_within_{a.tolerance:g}"] = max(kinds["tiermem"]) <= a.tolerance
    print(table(rows, ["bench", "figures", "count", f"within {a.tolerance:.0%}", "median |change|", "max |change|"]))
    # The machine is the one the after runs name (this comparison itself runs anywhere).
    after = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(a.folder, "*-after.json")))]
    device = after[0]["device"] if after else "unknown"
    date = (after[0]["date"][:10] if after else datetime.date.today().isoformat()).replace("-", "")
    # the after runs' commit (their JSONs say which code they measured), else this checkout's
    prov = {k: after[0][k] for k in ("commit", "commit_note") if k in after[0]} if after else provenance()
    obj = {"bench": "before_after", "device": device, **prov,
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "metrics": out_metrics,
           "checks": checks, "raw": raw}
    path = os.path.join(RESULTS, f"before_after-{device_slug(device)}-{date}.json")
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
