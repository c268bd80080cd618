"""Tensor parallelism (Megatron-style, with sequence parallelism) applied to a built model."""
