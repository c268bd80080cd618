"""Data parallelism: the DDP-based stack (gradient buckets, distributed optimizer) and the FSDP2 stack."""
