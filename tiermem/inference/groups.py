"""How an adopted module is cut into groups (:func:`module_groups`: a subtree of at most
``max_group_bytes`` each), and what planning needs to know of a group: its bytes as resident memory
lays them out (:func:`span_of`, :func:`weight_bytes`) and in the pinned home (:func:`home_layout`),
whether only embeddings read it (:func:`gathered_groups`), and whether it holds stacked experts
(:func:`is_stacked`). A module built on the meta device is grouped and sized the same way."""
from __future__ import annotations

import itertools
from typing import Any

__all__ = ["MAX_GROUP", "module_groups", "fit_groups", "fit_cap", "weight_bytes", "span_of", "span_bytes", "home_layout",
           "gathered_groups", "enclosing_groups", "is_stacked"]

MAX_GROUP = 160 << 20


def module_groups(module: Any, max_group_bytes: int = MAX_GROUP) -> list[tuple[str, Any, list[tuple[str, Any]]]]:
    """(name, root module, [(tensor name, tensor)]) per group: a subtree whose tensors come to at
    most ``max_group_bytes`` is one group (one allocation, one CUDA call per move); a bigger one
    gives its own direct tensors a group and splits into its children. A tensor shared by several
    modules (tied weights) belongs to the first group that reaches it."""
    # One walk in named_modules' order (pre-order, shared modules at each place): a subtree is
    # then a run of it, and its tensors in named_parameters' then named_buffers' order are
    # slices; asking each module for its subtree's tensors walked the model once per level
    # (60-100 ms for the 73 layers of bench/offload_disk.py's Qwen2, on a CPU machine).
    order: list[tuple[str, Any]] = []
    ends: list[int] = []
    params: list[tuple[str, Any]] = []
    buffers: list[tuple[str, Any]] = []
    p_at: list[int] = []        # per walk position: where its own parameters start in ``params``
    b_at: list[int] = []
    span: dict[int, int] = {}    # each tensor's bytes as a group member, reckoned once

    def walk(m: Any, name: str) -> None:
        i = len(order)
        order.append((name, m))
        ends.append(0)
        p_at.append(len(params))
        b_at.append(len(buffers))
        prefix = f"{name}." if name else ""
        params.extend((prefix + n, t) for n, t in m._parameters.items() if t is not None)
        buffers.extend((prefix + n, t) for n, t in m._buffers.items() if t is not None)
        for t in itertools.chain(m._parameters.values(), m._buffers.values()):
            if t is not None and id(t) not in span:
                span[id(t)] = span_of(t)
        for cname, child in m._modules.items():
            if child is not None:
                walk(child, prefix + cname)
        ends[i] = len(order)

    walk(module, "")
    p_at.append(len(params))
    b_at.append(len(buffers))
    seen: set[int] = set()
    out: list[tuple[str, Any, list[tuple[str, Any]]]] = []

    def fresh(items: Any) -> list[tuple[str, Any]]:
        return [(n, t) for n, t in items if id(t) not in seen]

    def visit(i: int) -> None:
        name, m = order[i]
        j = ends[i]
        sub = fresh(params[p_at[i]:p_at[j]] + buffers[b_at[i]:b_at[j]])
        uniq = list({id(t): (n, t) for n, t in sub}.values())
        if not uniq:
            return
        if sum(span[id(t)] for _, t in uniq) <= max_group_bytes or j == i + 1:
            seen.update(id(t) for _, t in uniq)
            out.append((name or "<root>", m, uniq))
            return
        own = fresh(params[p_at[i]:p_at[i + 1]] + buffers[b_at[i]:b_at[i + 1]])
        if own:
            seen.update(id(t) for _, t in own)
            out.append((name or "<root>", m, own))
        k = i + 1
        while k < j:                 # each child's subtree, in order
            visit(k)
            k = ends[k]

    visit(0)
    return out


def fit_groups(module: Any, found: list, budget: int, lookahead: int) -> list:
    """``found`` (module_groups at MAX_GROUP), or the module cut into smaller groups when the budget
    is too small to stream groups that big: at most ``budget / (2 x lookahead)`` bytes each, so
    that the window of ``lookahead`` slots takes at most half the budget and a small budget still
    streams its layers a block at a time rather than reading them in place (NOTE [no plan
    collapse] in inference/plan.py). A module that holds everything resident keeps its groups."""
    cap = fit_cap(found, budget, lookahead)
    return found if cap is None else module_groups(module, cap)


def fit_cap(found: list, budget: int, lookahead: int) -> int | None:
    """The group size :func:`fit_groups` cuts ``found`` to for ``budget``, or None where it
    keeps them."""
    cap = budget // (2 * max(1, lookahead))
    sizes = [sum(span_of(t) for _, t in own) for _, _, own in found]
    if budget <= 0 or budget >= sum(sizes) or cap >= MAX_GROUP or all(n <= cap for n in sizes):
        return None
    return max(1, cap)


def is_stacked(tensors: list[Any]) -> bool:
    """Parameters stacked along one leading dimension, a slice per expert (a mixture-of-experts
    layer's expert weights): a forward of few tokens indexes the slices its router picked."""
    import torch
    ps = [t for t in tensors if isinstance(t, torch.nn.Parameter)]
    return bool(ps) and all(p.dim() >= 3 and p.shape[0] == ps[0].shape[0] > 1 for p in ps)


def enclosing_groups(found: list) -> set[str]:
    """The groups whose module encloses other groups' modules (a parent's own tensors, a Mamba
    mixer's A_log beside its projections, an attention's sinks beside its q/k/v): the parent's
    forward runs its children's while it holds its own tensors, so a slot of its own would be
    taken by theirs while still in use. They are read in place, like embeddings' groups
    (NOTE [streaming plan])."""
    roots = {id(m) for _, m, _ in found}
    return {name for name, m, _ in found if any(id(sub) in roots for sub in m.modules() if sub is not m)}


def gathered_groups(module: Any, found: list) -> set[str]:
    """The groups only embeddings use: a lookup reads the rows of its tokens, so reading them in
    place moves a few KiB where a slot would move the whole table (NOTE [streaming plan])."""
    import torch
    owner = {id(t): mname for mname, _, own in found for _, t in own}
    users: dict[str, list[Any]] = {}
    for m in module.modules():
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None and id(t) in owner:
                users.setdefault(owner[id(t)], []).append(m)
    return {g for g, ms in users.items() if all(isinstance(m, torch.nn.Embedding) for m in ms)}


def home_layout(tensors: list[Any], align: int = 256) -> tuple[list[int], int]:
    """(offset of each tensor, bytes) of a streamed group in the pinned home, a slot or a staging
    buffer: the tensors back to back, each ``align``-byte aligned."""
    offs, n = [], 0
    for t in tensors:
        offs.append(n)
        n += -(-max(t.numel() * t.element_size(), 1) // align) * align
    return offs, n


def span_bytes(nbytes: int) -> int:
    """Device bytes a tensor of ``nbytes`` takes as a group member (see member_span)."""
    from ..core.ranges import member_span
    return member_span(nbytes)[0]


def weight_bytes(module: Any) -> int:
    """The bytes of ``module``'s parameters and buffers as wrap_module lays them out (each
    tensor once, tied weights too): ``budget=weight_bytes(model) // 4`` keeps about a quarter of
    them resident. Meta tensors count too, so a model built on the meta device can be sized."""
    return sum(span_of(t) for _, _, own in module_groups(module) for _, t in own)


def span_of(t: Any) -> int:
    return span_bytes(t.numel() * t.element_size())
