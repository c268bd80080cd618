"""Distributed checkpoints: state, on-disk protocol, save and resume policy, loading."""
