"""Context parallelism: load-balanced causal chunks of each sequence and exact ring attention over them."""
