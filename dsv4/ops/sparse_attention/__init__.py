"""Sparse MQA attention with per-head sinks over a per-query index set."""

from dsv4.ops.sparse_attention.reference import sparse_attention

__all__ = ["sparse_attention"]
