"""Make sure the run's token data exists: rank 0 prepares it, the others wait and read it."""

from __future__ import annotations

import torch.distributed as dist

from moeforge.config import Config
from moeforge.data import DataMeta, load_meta, prepare_data


def ensure_data(cfg: Config, is_main: bool) -> DataMeta:
    """Prepare ``cfg.data`` on rank 0 (idempotent), then load its metadata on every rank."""
    if is_main:
        prepare_data(cfg.data)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return load_meta(cfg.data.data_dir)
