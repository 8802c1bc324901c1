"""The tables docs/training.md quotes from bench/probes/probe_graph_plans.py's results, computed
again from the committed JSON, on any machine (no GPU): each replayed plan's prediction against
its replays, and the model fitted to one plan's replays (as NOTE [graph choice] fits it)
predicting another plan of the same model and budget.

    python bench/probes/graph_plans_report.py [bench/results/probe_graph_plans-h100-20261127-d16ed8c.json]
Writes bench/results/graph_plans_report-<name of the input>.json.
"""
import dataclasses
import json
import os
import sys

import _path  # noqa: F401 - the repository root on sys.path

from tiermem.planning import plan_training
from tiermem.training.plan import SavedRecord, StepTrace, evaluate, fit_compute, scaled

DEFAULT = os.path.join(os.path.dirname(__file__), "..", "results", "probe_graph_plans-h100-20261127-d16ed8c.json")
SETS = ("resident_blocks", "measured_recompute", "recomputable")


def trace_of(d):
    d = dict(d)
    d["saved"] = tuple(SavedRecord(**r) for r in d["saved"])
    for k, v in d.items():
        if k in SETS:
            d[k] = frozenset(v)
        elif isinstance(v, list):
            d[k] = tuple(v)
    return StepTrace(**d)


def plan_of(rec, trace):
    """The recorded plan's choices, as a TrainPlan the model can price under ``trace``."""
    t = dataclasses.replace(trace, resident_blocks=frozenset(rec["resident_blocks"]))
    base = plan_training(t, rec["budget"], margin=rec["margin"], link_GBps=rec["link_GBps"],
                         recompute="always" if rec["recompute"] else "never")
    p = dataclasses.replace(base, resident_blocks=frozenset(rec["resident_blocks"]),
                            recompute=frozenset(rec["recompute"]), keep=frozenset(rec["keep"]))
    return t, evaluate(t, p)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    d = json.load(open(path))
    replayed = []
    for r in d["runs"]:
        if "error" in r:
            continue
        trace = trace_of(r["traces"][-1])
        for k, ms in r["replay_median_ms"].items():
            rec = r["plans"][int(k)]
            replayed.append((r["model"], r["ratio"], r["mode"], rec, ms, trace))
    out = {"source": os.path.basename(path), "device": d.get("device"), "commit": d.get("commit"),
           "replays": [], "cross": []}
    print(f"{'model':<5} {'budget':>6} {'mode':<7} {'kind':<9} {'recomputed':>10} {'predicted':>9} {'replayed':>9} ratio")
    for m, ratio, mode, rec, ms, _ in replayed:
        q = rec["predicted_ms"] / ms
        out["replays"].append({"model": m, "ratio": ratio, "mode": mode, "kind": rec["kind"],
                               "recomputed": len(rec["recompute"]), "predicted_ms": rec["predicted_ms"],
                               "replay_ms": ms, "predicted_over_replayed": round(q, 3)})
        print(f"{m:<5} {'1/%g' % ratio:>6} {mode:<7} {rec['kind']:<9} {len(rec['recompute']):>10} "
              f"{rec['predicted_ms']:9.1f} {ms:9.1f} {q:.2f}")
    print("\nfitted to A's replays, B predicted (same model and budget, B's choices differing)")
    for a in replayed:
        for b in replayed:
            same = (a[0], a[1]) == (b[0], b[1])
            if not same or a[2] == b[2] or (a[3]["recompute"], a[3]["keep"]) == (b[3]["recompute"], b[3]["keep"]):
                continue
            _, pa = plan_of(a[3], a[5])
            f = fit_compute(pa, a[4])
            tb, _ = plan_of(b[3], b[5])
            pb = plan_of(b[3], scaled(tb, f))[1]
            pred = pb.predicted_seconds() * 1e3
            out["cross"].append({"model": a[0], "ratio": a[1], "fitted_to": a[2], "fitted_recomputed": len(a[3]["recompute"]),
                                 "predicted": b[2], "predicted_recomputed": len(b[3]["recompute"]),
                                 "scale": round(f, 3), "predicted_ms": round(pred, 1), "replay_ms": b[4],
                                 "predicted_over_replayed": round(pred / b[4], 3)})
            print(f"{a[0]:<5} 1/{a[1]:g} {a[2]}({len(a[3]['recompute'])}) -> {b[2]}({len(b[3]['recompute'])}): "
                  f"x{f:.2f}, predicted {pred:.1f} ms, replayed {b[4]:.1f} ms, {pred / b[4]:.2f}")
    name = os.path.splitext(os.path.basename(path))[0].replace("probe_graph_plans", "graph_plans_report")
    dest = os.path.join(os.path.dirname(__file__), "..", "results", name + ".json")
    with open(dest, "w") as fh:
        json.dump(out, fh, indent=1)
    print("wrote", os.path.relpath(dest))


if __name__ == "__main__":
    main()
