"""How the package computes on a CPU or GPU: which fast paths run (:mod:`.fast_paths`), the
per-record gradients (:mod:`.per_sample`, :mod:`.ghost_clipping`), the written-out matching
gradient (:mod:`.second_order`), the C kernels (:mod:`.kernels`), and the process's threads,
allocator and environment (:mod:`.threads`, :mod:`.allocator`, :mod:`.runtime_env`,
:mod:`.mapped_tensors`). Imports no torch on its own."""
