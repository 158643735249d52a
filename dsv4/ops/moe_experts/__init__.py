"""Routed-expert op: reference implementations and the stored-weight container they take."""

from dsv4.ops.moe_experts.reference import (moe_experts, moe_experts_gathered, moe_experts_grouped, moe_experts_loop,
                                            swiglu)
from dsv4.ops.moe_experts.stack import ExpertStack

__all__ = ["ExpertStack", "moe_experts", "moe_experts_gathered", "moe_experts_grouped", "moe_experts_loop", "swiglu"]
