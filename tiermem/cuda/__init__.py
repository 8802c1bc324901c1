"""The CUDA layer: every raw CUDA call (:mod:`.runtime`), the backend protocol the engine talks to
(:mod:`.backend`) with its books of events across a graph capture (:mod:`.capture`), and the
staging rings (:mod:`.staging`). Nothing above this layer calls CUDA directly."""
