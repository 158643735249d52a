"""Custom CPU/CUDA kernels called through XLA FFI.

No kernel library is built yet: the model runs on the pure-JAX reference backend
(`dsv4.ops.registry.Backend.REFERENCE`). The FFI build (CMake via scikit-build-core) and
its targets arrive with the kernels themselves; importing this package registers nothing.
"""
