"""Hot ops: one folder per op with `reference.py` (pure JAX, the semantics).

`Backend` selects the implementation; each backend is a separate function behind an
enum-keyed registry (`dsv4.ops.registry`).
"""
