"""The lower bounds the benches set tiermem's times against: what any design must move over the
link (or read from the drive), from the model, the budgets and the rates measured in the same run.

A bound never counts the bytes tiermem chose to move: a plan that moves more than it must would
otherwise be judged against its own excess. Where a bench also reports the time of the bytes the
plan moved, it names that figure for what it is (``..._vs_plan_bytes``), beside the bound.
Sizes are bytes, rates GB/s (1e9 bytes a second), times seconds. No GPU; tests/test_bounds.py.
"""
from __future__ import annotations

import dataclasses


def _rate(gbps: float, what: str) -> float:
    if not gbps > 0:
        raise ValueError(f"{what} must be a positive rate in GB/s, got {gbps!r}")
    return gbps * 1e9


def _size(n: float, what: str) -> float:
    if not n >= 0:
        raise ValueError(f"{what} must be a size in bytes >= 0, got {n!r}")
    return n


# -- inference ------------------------------------------------------------------------------------


def forward_bytes(weights: int, budget: int, embeddings: int = 0) -> int:
    """Bytes a forward must bring over the link: every weight is read once a forward, the device
    holds at most ``budget`` bytes of them, and an embedding table is read in place (a lookup
    reads only its tokens' rows), so it need neither cross nor take the budget."""
    _size(weights, "weights"), _size(budget, "budget"), _size(embeddings, "embeddings")
    if embeddings > weights:
        raise ValueError(f"embeddings ({embeddings}) cannot exceed the weights ({weights})")
    return max(0, weights - embeddings - budget)


def forward_seconds(weights: int, budget: int, embeddings: int, h2d_GBps: float) -> float:
    """The forward's link bound: :func:`forward_bytes` at the pinned host-to-device rate."""
    return forward_bytes(weights, budget, embeddings) / _rate(h2d_GBps, "h2d_GBps")


def routed_decode_bytes(weights: int, budget: int, embeddings: int, experts: int, routed: float) -> float:
    """Bytes a mixture-of-experts decode step must bring over the link: the weights it reads are
    all but the experts its router did not pick (``experts``: every expert's bytes; ``routed``:
    the picked experts' bytes a step, measured), and the budget holds at most ``budget`` of them."""
    _size(experts, "experts"), _size(routed, "routed")
    if routed > experts:
        raise ValueError(f"routed bytes ({routed}) cannot exceed the experts' ({experts})")
    read = forward_bytes(weights, 0, embeddings) - experts + routed
    if read < 0:
        raise ValueError("the experts cannot exceed the weights less the embeddings")
    return max(0.0, read - budget)


@dataclasses.dataclass(frozen=True)
class DiskBound:
    """A forward of a model larger than its device and host budgets: ``link_bytes`` cross the
    link (all but what the device holds), ``disk_bytes`` of them come from the drive (all but
    what the device and the host hold). ``seconds`` is the bound (the drive and the link
    working at once, each at its rate); ``serial_seconds`` takes them one after the other."""

    link_bytes: int
    disk_bytes: int
    link_seconds: float
    disk_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.link_seconds, self.disk_seconds)

    @property
    def serial_seconds(self) -> float:
        return self.link_seconds + self.disk_seconds


def disk_forward(weights: int, budget: int, host_budget: int, embeddings: int, link_GBps: float,
                 disk_GBps: float) -> DiskBound:
    """The forward's bound with a disk tier: :class:`DiskBound` from the model and the two budgets."""
    _size(host_budget, "host_budget")
    link = forward_bytes(weights, budget, embeddings)
    disk = max(0, link - host_budget)
    return DiskBound(link, disk, link / _rate(link_GBps, "link_GBps"), disk / _rate(disk_GBps, "disk_GBps"))


# -- training -------------------------------------------------------------------------------------


def persistent_state_bytes(params: int, param_bytes: int = 4, states_per_param: int = 2) -> int:
    """The training state that outlives a step: the parameters and the optimizer's states
    (AdamW: two moments; SGD with momentum: one), ``param_bytes`` each. Gradients are left out:
    a design that steps each block's optimizer inside backward (tiermem does) needs no gradient
    to outlive its block, so no gradient must cross the link."""
    if params < 0 or param_bytes <= 0 or states_per_param < 0:
        raise ValueError(f"bad state: params={params}, param_bytes={param_bytes}, states={states_per_param}")
    return params * param_bytes * (1 + states_per_param)


@dataclasses.dataclass(frozen=True)
class StepBound:
    """A training step whose state does not fit its budget: ``cross_bytes`` must come in and go
    out once a step; ``transfer_seconds`` is that at the rates measured (each direction at its
    own rate, and both together at the duplex rate); ``seconds`` is the larger of that and the
    resident step's compute time."""

    cross_bytes: int
    transfer_seconds: float
    compute_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.transfer_seconds, self.compute_seconds)

    @property
    def limited_by(self) -> str:
        return "link" if self.transfer_seconds > self.compute_seconds else "compute"


def train_step(state: int, budget: int, h2d_GBps: float, d2h_GBps: float, duplex_GBps: float,
               compute_seconds: float) -> StepBound:
    """The bound of one training step: the state the budget cannot hold (``state`` - ``budget``,
    :func:`persistent_state_bytes`) crosses in and out once; activations add nothing, since a
    design may recompute them rather than move them (which costs compute, never less than the
    resident step's). ``duplex_GBps`` is both directions' bytes together a second."""
    _size(state, "state"), _size(budget, "budget"), _size(compute_seconds, "compute_seconds")
    cross = max(0, state - budget)
    transfer = max(cross / _rate(h2d_GBps, "h2d_GBps"), cross / _rate(d2h_GBps, "d2h_GBps"),
                   2 * cross / _rate(duplex_GBps, "duplex_GBps"))
    return StepBound(cross, transfer, compute_seconds)


# -- long context ---------------------------------------------------------------------------------


def kv_decode_bytes(cache_bytes: int, kv_budget: int) -> int:
    """Bytes a decode step must bring over the link for its KV cache: attention reads every
    cached key and value once a step, and the device holds at most ``kv_budget`` bytes of them
    (however a design spends that budget: resident layers, slots, recent tokens)."""
    _size(cache_bytes, "cache_bytes"), _size(kv_budget, "kv_budget")
    return max(0, cache_bytes - kv_budget)


def kv_decode_seconds(cache_bytes: int, kv_budget: int, weights_bytes: int, h2d_GBps: float) -> float:
    """A decode step's link bound: :func:`kv_decode_bytes` plus the weights' own
    (:func:`forward_bytes`, 0 with the weights resident) at the pinned host-to-device rate."""
    return (kv_decode_bytes(cache_bytes, kv_budget) + _size(weights_bytes, "weights_bytes")) / _rate(h2d_GBps, "h2d_GBps")


def ratio(measured: float, bound: float) -> float:
    """measured / bound, rounded as the JSONs keep it; inf where the bound is zero."""
    return round(measured / bound, 3) if bound > 0 else float("inf")


def below_bound_note(what: str, value: float, floor: float = 0.98) -> str | None:
    """A bench prints this (and keeps it in its JSON) when a time came out below its lower bound
    by more than the noise: a real bound cannot be beaten, so the measurement or the bound's
    inputs are off, and the figure must not be read as it stands."""
    if value >= floor:
        return None
    return (f"{what} = {value:.3f} is below {floor} of a lower bound, which no design can beat: the link or "
            "drive rate measured for the bound was slower than during the timed run (the rates drift "
            "within a run), or work escaped the timed span; read the raw rates before quoting it")
