"""Routed-expert SwiGLU with clamps: naive loop oracle and the grouped (ragged_dot) path."""

from dsv4.ops.moe_experts.reference import moe_experts_grouped, moe_experts_loop, swiglu

__all__ = ["moe_experts_grouped", "moe_experts_loop", "swiglu"]
