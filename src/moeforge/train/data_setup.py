"""Make sure the run's token data exists: rank 0 prepares it, the others wait and read it."""

from __future__ import annotations

from moeforge.config import Config
from moeforge.data import DataMeta, load_meta, prepare_data
from moeforge.parallel.mesh import MoEMesh
from moeforge.train.distributed import barrier


def ensure_data(cfg: Config, mesh: MoEMesh | None = None) -> DataMeta:
    """Prepare ``cfg.data`` on rank 0 of ``mesh`` (idempotent), then load its metadata on every rank."""
    mesh = mesh or MoEMesh()
    if mesh.rank == 0:
        prepare_data(cfg.data)
    barrier(mesh)
    return load_meta(cfg.data.data_dir)
