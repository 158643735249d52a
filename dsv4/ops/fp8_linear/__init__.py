"""The FP8 GEMM of REF's quantised linears: FP8 activations (1x128) x FP8 weights (128x128)."""

from dsv4.ops.fp8_linear.reference import fp8_linear

__all__ = ["fp8_linear"]
