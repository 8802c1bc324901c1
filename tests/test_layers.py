"""The package's shape, held by its source: imports point one way (down the layers in
tiermem/_tier.py's docstring), no import cycle, and no module reaches into another's private
members. Read from the AST, so it runs anywhere (no GPU, no torch)."""
from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiermem")

# Lowest first. A new module must be placed here, on purpose.
LAYERS = [
    ("base", {"_errors", "_dtypes", "_limits", "roles", "_default", "_hostpages", "_held"}),
    ("cuda", {"_cuda", "_capture", "_backend", "_staging"}),
    ("core", {"_stats", "_lease", "_transfer", "_stream", "_tensor", "_report", "_engine"}),
    ("adapters", {"_devmem", "_torch", "_swap", "_trainplan", "_arena", "_meter", "_recompute", "_savedhooks",
                  "_workspaces", "_replay", "_graphchoice", "_clip", "_load", "_kvikio", "_disk", "_torch_alloc",
                  "_um_budget", "_cupy", "_scoped", "models",
                  "_moduleplan", "_modulegroups", "_modulesources", "_moduletransport", "_module",
                  "_trainslots", "_trainstates", "_trainoptions", "_trainclip", "_trainresident", "_trainchoice",
                  "_trainmemory", "_kvcache", "_stepgraph", "_train"}),
    ("face", {"_tier"}),
    ("api", {"_api", "__init__", "_plan", "_demo", "_cli", "__main__", "errors", "planning", "handles", "arrays",
             "torch_memory"}),
]
LAYER = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for f in sorted(os.listdir(PKG)):
        if f.endswith(".py"):
            with open(os.path.join(PKG, f), encoding="utf-8") as fh:
                out[f[:-3]] = ast.parse(fh.read(), f)
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module, known: set[str], annotations: bool = False) -> set[str]:
    """The package's modules ``tree`` imports when it runs, at its top or inside functions, and
    with ``annotations`` also those under ``if TYPE_CHECKING:`` (for annotations only)."""
    found: set[str] = set()

    def walk(node: ast.AST) -> None:
        for ch in ast.iter_child_nodes(node):
            if _type_checking(ch) and not annotations:
                continue
            if isinstance(ch, ast.ImportFrom) and ch.level == 1:
                if ch.module:
                    found.add(ch.module.split(".")[0])
                else:
                    found.update(a.name for a in ch.names if a.name in known)
            elif isinstance(ch, ast.ImportFrom) and (ch.module or "").startswith("tiermem."):
                found.add(ch.module.split(".")[1])
            elif isinstance(ch, ast.Import):
                found.update(a.name.split(".")[1] for a in ch.names if a.name.startswith("tiermem."))
            walk(ch)
    walk(tree)
    return found & known


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _top_level(tree: ast.Module) -> set[str]:
    """Private names a module defines at its top."""
    out = set()
    for node in tree.body:
        targets = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            targets = [node.name]
        elif isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [node.target.id]
        out.update(t for t in targets if _private(t))
    return out


def _members(tree: ast.Module) -> set[str]:
    """Private members a module's classes define: methods, class attributes, and the
    attributes its code sets on ``self``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for b in node.body:
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(b.name):
                    out.add(b.name)
                elif isinstance(b, ast.Assign):
                    out.update(t.id for t in b.targets if isinstance(t, ast.Name) and _private(t.id))
                elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name) and _private(b.target.id):
                    out.add(b.target.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id == "self" and _private(node.attr)):
            out.add(node.attr)
    return out


MODULES = _modules()


def test_every_module_has_a_layer():
    assert sorted(set(MODULES) - set(LAYER)) == [], "place the new module in LAYERS"
    assert sorted(set(LAYER) - set(MODULES)) == [], "LAYERS names a module that is gone"


def test_imports_point_down():
    up = []
    for m, tree in MODULES.items():
        for dep in _imports(tree, set(MODULES)):
            if LAYER[dep] > LAYER[m]:
                up.append(f"{m} ({LAYERS[LAYER[m]][0]}) imports {dep} ({LAYERS[LAYER[dep]][0]})")
    assert up == []


@pytest.mark.parametrize("annotations", [False, True], ids=["run-time", "with-annotations"])
def test_no_import_cycle(annotations):
    """Not even through imports made for annotations: a module that needs a type from a higher
    one names what it uses as a Protocol (_tensor.Tier, _transfer.Owner)."""
    graph = {m: _imports(t, set(MODULES), annotations) - {m} for m, t in MODULES.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_module_reaches_into_another_modules_private_members():
    owners: dict[str, set[str]] = defaultdict(set)
    members = {m: _members(t) for m, t in MODULES.items()}
    top = {m: _top_level(t) for m, t in MODULES.items()}
    for m, names in members.items():
        for n in names:
            owners[n].add(m)
    reach = []
    for m, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                reach += [f"{m}: from .{node.module} import {a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if (isinstance(node.value, ast.Name) and node.value.id in MODULES and node.value.id != m
                        and node.attr in top[node.value.id]):
                    reach.append(f"{m}:{node.lineno}: {node.value.id}.{node.attr}")
                    continue
                others = owners.get(node.attr, set()) - {m}
                # torch's own private members (Module._parameters, torch._C) are not the package's
                if others and node.attr not in members[m]:
                    reach.append(f"{m}:{node.lineno}: .{node.attr} of {', '.join(sorted(others))}")
    assert reach == []


@pytest.mark.parametrize("bad", [
    "from ._tier import Tier\n",                            # core importing the face
    "def f():\n    from ._api import default_tier\n",       # a lazy import up is still up
])
def test_the_checks_catch_what_they_are_for(bad):
    tree = ast.parse(bad)
    assert any(LAYER[d] > LAYER["_engine"] for d in _imports(tree, set(MODULES)))


def test_the_private_check_catches_a_reach():
    tree = ast.parse("def f(tier):\n    return tier._drop([])\n")
    engine = _members(MODULES["_engine"])
    assert "_drop" in engine
    hits = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in engine]
    assert hits == ["_drop"]
