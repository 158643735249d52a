"""Quantise-and-store of new entries into a stored table (rings and pages)."""

from dsv4.ops.kv_write.reference import table_write

__all__ = ["table_write"]
