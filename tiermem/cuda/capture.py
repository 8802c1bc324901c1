"""Which events still mean something across a CUDA graph capture (NOTE [events across a capture]).

NOTE [events across a capture]
    A training step captured as a CUDA graph (NOTE [whole-step graphs] in training/stepgraph.py) runs
    tiermem's own Python as an eager step does: it records events, makes streams wait on them,
    and asks whether copies have finished. Under capture none of that work runs, and CUDA
    refuses two things: waiting inside the capture on an event recorded outside it (the
    dependency would cross the capture's boundary), and querying, synchronizing on or timing an
    event last recorded inside a capture, then or later (cudaErrorCapturedEvent). The backend
    stamps each event it records with the capture it was recorded in (0: none), and resolves
    every use of an event here:

    * Inside a capture, an event of the same capture is used as it is. A host-side check on it
      (a query, a synchronize) becomes a wait of the capturing stream on it and answers "done":
      the host cannot wait for work that has not run, and the ordering it wanted (the copy
      before whatever the host was about to let reuse its memory) is kept on the GPU instead.
    * Inside a capture, an event from before it is complete: the capture starts after a device
      synchronize (torch.cuda.graph does one). A wait on it becomes a wait on the capturing
      stream's present, which also brings a side stream into the capture before its copies;
      a host-side check answers "done".
    * Outside a capture, an event recorded in one stands for that capture's work, which runs
      only when its graph replays, and every replay ends with all of its streams joined back
      into the stream it was launched on. A use of such an event becomes a use of the event
      the last replay's launch recorded after it (``replayed``); before any replay the
      captured work never ran, and there is nothing to wait for.

    Timing such an event is refused (there is no time to read): the training handle drops the
    captured step's timing events instead of reading them.
"""
from __future__ import annotations

from typing import Any

__all__ = ["CaptureEpochs"]


class CaptureEpochs:
    """The backend's books for NOTE [events across a capture]: the capture running now (0:
    none), and the event recorded after the last replay of a captured graph."""

    def __init__(self) -> None:
        self.count = 0             # captures begun so far
        self.now = 0               # the running capture's number, 0 outside one
        self.after_replay: Any = None
        self.streams: set[int] = set()     # streams the running capture queued work or waits on

    def begin(self) -> int:
        if self.now:
            raise RuntimeError("tiermem: captures do not nest")
        self.count += 1
        self.now = self.count
        self.streams = set()
        return self.now

    def end(self) -> None:
        self.now = 0

    def stamp(self, event: Any) -> None:
        """``event`` was just recorded."""
        try:
            event.capture = self.now
        except AttributeError:     # an event type that cannot carry the stamp: never captured
            pass

    def resolve(self, event: Any) -> tuple[str, Any]:
        """How to use ``event`` now: ("use", event), ("present", None) for the capturing stream's
        present, or ("done", None) when there is nothing to wait for."""
        made = getattr(event, "capture", 0)
        if self.now:
            return ("use", event) if made == self.now else ("present", None)
        if not made:
            return ("use", event)
        return ("use", self.after_replay) if self.after_replay is not None else ("done", None)
