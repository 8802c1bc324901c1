"""torch's caching-allocator controls for the device a Tier's memory is on (NOTE [device memory]).

NOTE [device memory]
    Training caps torch's caching allocator (the per-process fraction), reads its reserved bytes
    and peaks to plan, and waits for the device. Those are ``torch.cuda`` calls on a real GPU. On
    the fake backend of the CPU tests the Tier's "device" memory is host memory, and a model
    trains on the CPU: torch's CPU allocator has no cache, no peak and no cap, so there the
    controls do nothing and read zero (the fraction is remembered, so a test can see it set and
    put back). The choice follows the backend's DLPack device: host memory (kDLCPU) or CUDA.
"""
from __future__ import annotations

import contextlib
from typing import Any

from ..errors import ConfigError

KDL_CPU = 1


class DeviceMemory:
    """torch.cuda's allocator controls for CUDA device ``index``."""

    def __init__(self, torch: Any, index: int):
        self.torch = torch
        self.device = torch.device("cuda", index)
        self._streams: dict[int, Any] = {}      # backend handle -> its torch ExternalStream

    def synchronize(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def sync_current(self) -> None:
        """Wait for the current stream's work only."""
        self.torch.cuda.current_stream(self.device).synchronize()

    def empty_cache(self) -> None:
        self.torch.cuda.empty_cache()

    def reserved(self) -> int:
        return int(self.torch.cuda.memory_reserved(self.device))

    def max_reserved(self) -> int:
        return int(self.torch.cuda.max_memory_reserved(self.device))

    def reserved_without(self, ptrs: set[int]) -> int:
        """The device bytes torch's other tensors hold: its live blocks less the tensors whose
        storages start at ``ptrs`` (NOTE [outside memory] in training/memory.py). Free space inside a
        segment is not counted: the step can use it, so its peak counts it."""
        total = 0
        for seg in self.torch.cuda.memory_snapshot():
            if seg.get("device", self.device.index) != self.device.index:
                continue
            total += sum(int(b["size"]) for b in seg.get("blocks", ())
                         if b.get("state") != "inactive" and b["address"] not in ptrs)
        return total

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def fraction(self) -> float:
        get = getattr(self.torch.cuda, "get_per_process_memory_fraction", None)
        try:
            return float(get(self.device)) if get is not None else 1.0
        except Exception:       # an older torch, or no allocator yet: the default
            return 1.0

    def set_fraction(self, fraction: float) -> None:
        self.torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    def stream(self, handle: int) -> Any:
        """A context in which torch's current stream is the backend stream ``handle``: what the
        caching allocator hands out inside is that stream's (and is reused in its order)."""
        return self.torch.cuda.stream(self._ext(handle))

    def _ext(self, handle: int) -> Any:
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = self.torch.cuda.ExternalStream(handle, device=self.device)
        return s

    def free_after(self, tensor: Any, handles: list[int]) -> None:
        """``tensor``'s memory, once freed, is not handed out again before the work queued so far
        on each stream of ``handles`` is done (torch's ``record_stream``: the allocator records an
        event on each at the free and reuses the block once they have passed, never making a
        stream wait)."""
        for h in handles:
            tensor.record_stream(self._ext(h))

    @staticmethod
    def handle_of(stream: Any) -> int | None:
        """The backend handle of a torch stream (None for a stream that has none)."""
        h = getattr(stream, "cuda_stream", None)
        return None if h is None else int(h)


class HostMemory:
    """The same controls where the Tier's device memory is host memory (NOTE [device memory])."""

    def __init__(self, torch: Any):
        self.torch = torch
        self.device = torch.device("cpu")
        self._fraction = 1.0

    def synchronize(self) -> None:
        pass

    def sync_current(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def reserved(self) -> int:
        return 0

    def reserved_without(self, ptrs: set[int]) -> int:
        return 0

    def max_reserved(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def fraction(self) -> float:
        return self._fraction

    def set_fraction(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ConfigError(f"a memory fraction is in [0, 1], got {fraction}")
        self._fraction = float(fraction)

    def stream(self, handle: int) -> Any:
        """Host work has no streams: everything runs in order."""
        return contextlib.nullcontext()

    def free_after(self, tensor: Any, handles: list[int]) -> None:
        pass

    @staticmethod
    def handle_of(stream: Any) -> int | None:
        return None


def device_memory(torch: Any, backend: Any, index: int) -> DeviceMemory | HostMemory:
    """The controls for ``backend``'s memory: host memory's where it is host memory, else CUDA's."""
    kind, _ = backend.dlpack_device()
    return HostMemory(torch) if kind == KDL_CPU else DeviceMemory(torch, index)
