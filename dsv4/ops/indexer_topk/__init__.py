"""Lightning-indexer scoring and causal top-k selection of compressed entries."""

from dsv4.ops.indexer_topk.reference import indexer_scores, indexer_topk

__all__ = ["indexer_scores", "indexer_topk"]
