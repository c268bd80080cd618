"""Helpers for tests: real multi-process runs on gloo."""

from moeforge.testing.distributed import run_distributed_test

__all__ = ["run_distributed_test"]
