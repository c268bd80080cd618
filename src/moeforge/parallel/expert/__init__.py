"""Expert parallelism: experts sharded over the ep dim, and the dispatchers that carry tokens to them."""
