"""CuPy: the drop-in allocator (:mod:`.allocator`) and residency for its arrays (:mod:`.scoped`)."""
