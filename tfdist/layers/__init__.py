"""Keras layers that tfdist adds: `ShardedEmbedding` (an embedding table in row shards over parameter servers)."""

from tfdist.layers.sharded_embedding import ShardedEmbedding

__all__ = ["ShardedEmbedding"]
