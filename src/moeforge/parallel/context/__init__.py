"""Context parallelism: load-balanced causal chunks of each sequence, attention kept exact."""
