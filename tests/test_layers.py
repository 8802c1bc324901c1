"""The package's shape, held by its source: imports point one way (down the layers in
tiermem/_tier.py's docstring), no import cycle, and no module reaches into another's private
members. Read from the AST, so it runs anywhere (no GPU, no torch)."""
from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiermem")

# Lowest first. A layer is a folder of the package; the public modules at its top are placed by
# name. Each layer may import only the layers it names (never one above it), so siblings such as
# inference and cupy stay apart. A new folder or top-level module must be placed here, on purpose.
LAYERS = [
    ("base", {"base", "errors", "roles"}, set()),
    ("cuda", {"cuda"}, {"base"}),
    ("core", {"core"}, {"base", "cuda"}),
    ("pytorch", {"pytorch"}, {"base", "cuda", "core"}),
    ("cupy", {"cupy"}, {"base", "cuda", "core"}),
    ("inference", {"inference"}, {"base", "cuda", "core", "pytorch"}),
    ("training", {"training"}, {"base", "cuda", "core", "pytorch", "inference"}),
    ("testing", {"testing"}, set()),
    ("face", {"_tier"}, {"base", "cuda", "core", "pytorch", "cupy", "inference", "training"}),
    ("api", {"_api", "__init__", "__main__", "planning", "handles", "arrays", "torch_memory", "models", "cli"},
     {"base", "cuda", "core", "pytorch", "cupy", "inference", "training", "testing", "face"}),
]
INDEX = {name: i for i, (name, _, _) in enumerate(LAYERS)}


def layer_of(module: str) -> str:
    """The layer of a module named relative to the package (``core.engine``, ``errors``)."""
    head = module.split(".")[0]
    for name, members, _ in LAYERS:
        if head in members:
            return name
    raise KeyError(module)


def _modules() -> dict[str, ast.Module]:
    out = {}
    for root, _, files in os.walk(PKG):
        rel = os.path.relpath(root, PKG)
        pkg = "" if rel == "." else rel.replace(os.sep, ".")
        for f in sorted(files):
            if f.endswith(".py"):
                name = f[:-3] if not pkg else (pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}")
                with open(os.path.join(root, f), encoding="utf-8") as fh:
                    out[name] = ast.parse(fh.read(), f)
    return out


def _package(module: str) -> str:
    """The package a module's relative imports start from."""
    is_pkg = module == "__init__" or os.path.isdir(os.path.join(PKG, *module.split(".")))
    if module == "__init__":
        return ""
    return module if is_pkg else module.rpartition(".")[0]


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _resolve(module: str, node: ast.ImportFrom, known: set[str]) -> list[tuple[str, str, str]]:
    """(imported module, name imported, local alias) for each name of ``node``, the imported
    module being the package's module the name comes from (or is)."""
    if node.level:
        base = _package(module).split(".") if _package(module) else []
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        src = ".".join(base + ([node.module] if node.module else []))
    elif (node.module or "").startswith("tiermem.") or node.module == "tiermem":
        src = node.module[len("tiermem."):] if node.module != "tiermem" else ""
    else:
        return []
    out = []
    for a in node.names:
        sub = f"{src}.{a.name}" if src else a.name
        target = sub if sub in known else (src if src in known else (src or "__init__"))
        out.append((target, a.name, a.asname or a.name))
    return out


def _imports(module: str, tree: ast.Module, known: set[str], annotations: bool = False) -> set[str]:
    """The package's modules ``tree`` imports when it runs, at its top or inside functions, and
    with ``annotations`` also those under ``if TYPE_CHECKING:`` (for annotations only)."""
    found: set[str] = set()

    def walk(node: ast.AST) -> None:
        for ch in ast.iter_child_nodes(node):
            if _type_checking(ch) and not annotations:
                continue
            if isinstance(ch, ast.ImportFrom):
                found.update(t for t, _, _ in _resolve(module, ch, known))
            elif isinstance(ch, ast.Import):
                found.update(a.name[len("tiermem."):] for a in ch.names if a.name.startswith("tiermem."))
            walk(ch)
    walk(tree)
    return found & known


def _aliases(module: str, tree: ast.Module, known: set[str]) -> dict[str, str]:
    """Local names bound to the package's modules (``from ..cuda import runtime as _cuda``)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for target, name, alias in _resolve(module, node, known):
                if target.endswith(name) and target in known:
                    out[alias] = target
    return out


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
    unplaced = []
    for m in MODULES:
        try:
            layer_of(m)
        except KeyError:
            unplaced.append(m)
    assert unplaced == [], "place the new folder or module in LAYERS"
    named = {x for _, members, _ in LAYERS for x in members}
    assert sorted(n for n in named if not any(m == n or m.startswith(n + ".") for m in MODULES)) == [], \
        "LAYERS names a module or folder that is gone"


def test_folders_are_the_layers():
    """Every folder of the package is a layer's (no module's layer is told by its name alone)."""
    folders = {m.split(".")[0] for m in MODULES if "." in m}
    assert folders <= {x for _, members, _ in LAYERS for x in members}
    assert sorted(m for m in MODULES if "." not in m and os.path.isfile(os.path.join(PKG, m + ".py"))) == sorted(
        {"__init__", "__main__", "_api", "_tier", "errors", "roles", "planning", "handles", "arrays",
         "torch_memory", "models"}), "the package's top holds its public modules and its face only"


def test_imports_point_down():
    allowed = {name: deps | {name} for name, _, deps in LAYERS}
    up = []
    for m, tree in MODULES.items():
        for dep in _imports(m, tree, set(MODULES)):
            if layer_of(dep) not in allowed[layer_of(m)]:
                up.append(f"{m} ({layer_of(m)}) imports {dep} ({layer_of(dep)})")
    assert up == []


def test_no_layer_lists_one_above_it():
    assert [(n, d) for n, _, deps in LAYERS for d in deps if INDEX[d] >= INDEX[n]] == []


@pytest.mark.parametrize("annotations", [False, True], ids=["run-time", "with-annotations"])
def test_no_import_cycle(annotations):
    """Not even through imports made for annotations: a module that needs a type from a higher
    one names what it uses as a Protocol (core/tensor.py's Tier, core/transfer.py's Owner)."""
    graph = {m: _imports(m, t, set(MODULES), annotations) - {m} for m, t in MODULES.items()}
    # A package imports its own modules to re-export them; that is not a cycle through them.
    graph = {m: {d for d in deps if not (m in ("__init__",) or d.startswith(m + "."))} for m, deps in graph.items()}
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
    known = set(MODULES)
    for m, tree in MODULES.items():
        aliases = _aliases(m, tree, known)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                reach += [f"{m}: from {'.' * node.level}{node.module or ''} import {name}"
                          for target, name, _ in _resolve(m, node, known) if _private(name) and target != name
                          and not target.endswith("." + name) and not (target == name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                mod = aliases.get(node.value.id) if isinstance(node.value, ast.Name) else None
                if mod is not None and mod != m and node.attr in top[mod]:
                    reach.append(f"{m}:{node.lineno}: {node.value.id}.{node.attr}")
                    continue
                others = owners.get(node.attr, set()) - {m}
                # torch's own private members (Module._parameters, torch._C) are not the package's
                if others and node.attr not in members[m]:
                    reach.append(f"{m}:{node.lineno}: .{node.attr} of {', '.join(sorted(others))}")
    assert reach == []


@pytest.mark.parametrize("bad", [
    "from .._tier import Tier\n",                             # core importing the face
    "def f():\n    from .._api import default_tier\n",        # a lazy import up is still up
    "from ..training.handle import TieredTraining\n",         # core importing an adapter
])
def test_the_checks_catch_what_they_are_for(bad):
    tree = ast.parse(bad)
    deps = _imports("core.engine", tree, set(MODULES))
    assert deps and not any(layer_of(d) in ({"base", "cuda", "core"}) for d in deps)


def test_siblings_stay_apart():
    tree = ast.parse("from ..cupy.scoped import residency\n")
    (dep,) = _imports("inference.module", tree, set(MODULES))
    assert layer_of(dep) == "cupy" and "cupy" not in dict((n, d) for n, _, d in LAYERS)["inference"]


def test_the_private_check_catches_a_reach():
    tree = ast.parse("def f(tier, b):\n    return tier._bring_back(b)\n")
    engine = _members(MODULES["core.engine"])
    assert "_bring_back" in engine
    hits = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in engine]
    assert hits == ["_bring_back"]


def test_an_aliased_module_is_still_checked():
    tree = ast.parse("from ..cuda import runtime as _cuda\n")
    assert _aliases("core.engine", tree, set(MODULES)) == {"_cuda": "cuda.runtime"}
