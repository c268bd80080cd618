"""Parallelism applied to a built model: one DeviceMesh, then expert, pipeline, tensor, context and data parallelism."""
