"""PyTorch adoption, shared by inference and training: a tensor wrapped and unwrapped in place
(:mod:`.wrap`), torch's own allocations in managed memory (:mod:`.allocator`), torch's caching
allocator held to a budget (:mod:`.devmem`), what a held module refuses (:mod:`.held`), and what a CUDA graph capture leaves in torch
(:mod:`.unwind`, :mod:`.workspaces`, :mod:`.generators`)."""
