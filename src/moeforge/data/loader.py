"""The training loader, defined by the global batch, and the evaluation batches.

The loader is a pure function of ``(seed, epoch, position)``: epoch ``e`` is a
permutation of all window indices drawn from ``(seed, e)``; optimizer step
``s`` of the epoch consumes the global batch ``perm[s*G:(s+1)*G]`` (the
incomplete tail of an epoch is dropped); data-parallel rank ``r`` of ``W``
takes the contiguous slice ``[r*G/W, (r+1)*G/W)`` of it, cut into
micro-batches. With ``shift_windows``, epoch ``e >= 1`` tiles the tokens from
an offset in ``[0, seq_len)`` drawn from ``(seed, e)`` (:func:`epoch_offset`), so
a second pass over a small corpus reads new windows rather than the same ones
again; epoch 0 always starts at token 0. Hence every layout sees the same tokens in each step: one
process with micro-batch ``G/2`` gets exactly the rows that 2 ranks with
micro-batch ``G/2`` get, concatenated in rank order, and a resumed run
continues with the very rows an uninterrupted one would have read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moeforge.data.corpus import DataError
from moeforge.data.dataset import TokenWindows


def epoch_permutation(num_windows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The order of window indices in ``epoch``: a permutation drawn from ``(seed, epoch)``."""
    if not shuffle:
        return np.arange(num_windows, dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) & (2**64 - 1), int(epoch)]))
    return rng.permutation(num_windows).astype(np.int64)


def epoch_offset(seq_len: int, seed: int, epoch: int, shift: bool = True) -> int:
    """First token of epoch ``epoch``'s windows: 0 in epoch 0 or without ``shift``, else drawn from (seed, epoch)."""
    if not shift or epoch == 0:
        return 0
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) & (2**64 - 1), int(epoch), 1]))
    return int(rng.integers(0, seq_len))


class ShardedLoader:
    """Deterministic, resumable batches of one data-parallel rank.

    Args:
        dataset: the training windows.
        global_batch_size: windows per optimizer step over all ranks (``G``).
        micro_batch_size: windows per forward/backward pass on one rank.
        rank: this rank's index in the data-parallel group.
        world_size: size of the data-parallel group (``W``).
        seed: seeds the per-epoch permutations.
        shuffle: if False, every epoch reads the windows in order.
        shift_windows: start each epoch after the first at a seeded random offset (:func:`epoch_offset`).
    """

    def __init__(
        self,
        dataset: TokenWindows,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        shift_windows: bool = False,
    ) -> None:
        if global_batch_size < 1 or micro_batch_size < 1:
            raise ValueError(
                f"global_batch_size and micro_batch_size must be >= 1, got {global_batch_size} and {micro_batch_size}"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        per_pass = micro_batch_size * world_size
        if global_batch_size % per_pass:
            raise ValueError(
                f"train.global_batch_size ({global_batch_size}) must be a multiple of "
                f"train.micro_batch_size * data-parallel size "
                f"({micro_batch_size} * {world_size} = {per_pass})"
            )
        # a shifted epoch may hold one window fewer: every epoch must still fill a global batch
        fewest = dataset.num_windows(dataset.seq_len - 1) if shift_windows else len(dataset)
        if fewest < global_batch_size:
            raise DataError(
                f"{dataset.path}: holds {fewest} windows of {dataset.seq_len + 1} tokens, fewer than "
                f"one global batch ({global_batch_size}); lower train.global_batch_size or "
                "data.seq_len, or add text"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.shift_windows = shift_windows
        self.epoch = 0
        self.position = 0  # global batches already consumed in this epoch
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    @property
    def offset(self) -> int:
        """First token of the current epoch's windows."""
        return self._offset(self.epoch)

    @property
    def steps_per_epoch(self) -> int:
        """Complete global batches in the current epoch."""
        return self._steps_in(self.epoch)

    def _offset(self, epoch: int) -> int:
        return epoch_offset(self.dataset.seq_len, self.seed, epoch, self.shift_windows)

    def _steps_in(self, epoch: int) -> int:
        return self.dataset.num_windows(self._offset(epoch)) // self.global_batch_size

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    @property
    def tokens_per_step(self) -> int:
        """Input tokens of one global batch (all ranks)."""
        return self.global_batch_size * self.dataset.seq_len

    def _permutation(self) -> np.ndarray:
        if self._perm is None or self._perm_epoch != self.epoch:
            n = self.dataset.num_windows(self.offset)
            self._perm = epoch_permutation(n, self.seed, self.epoch, self.shuffle)
            self._perm_epoch = self.epoch
        return self._perm

    def global_batch_indices(self) -> np.ndarray:
        """Window indices of the next global batch (all ranks), without consuming it."""
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.global_batch_size
        return self._permutation()[start : start + self.global_batch_size]

    def next_step(self) -> list[torch.Tensor]:
        """This rank's micro-batches for the next optimizer step, each ``(micro, seq_len + 1)`` int64."""
        indices = self.global_batch_indices()
        per_rank = self.global_batch_size // self.world_size
        mine = indices[self.rank * per_rank : (self.rank + 1) * per_rank]
        self.position += 1
        m = self.micro_batch_size
        offset = self.offset
        return [self.dataset.rows(mine[i : i + m], offset) for i in range(0, per_rank, m)]

    def __iter__(self) -> ShardedLoader:
        return self

    def __next__(self) -> list[torch.Tensor]:
        return self.next_step()

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: where the next step starts (JSON-able, layout-independent)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the loader that produced ``state`` stopped."""
        try:
            epoch, position = state["epoch"], state["position"]
        except (KeyError, TypeError):
            raise ValueError(f"loader state must be a dict with 'epoch' and 'position', got {state!r}") from None
        if not (isinstance(epoch, int) and isinstance(position, int) and epoch >= 0 and position >= 0):
            raise ValueError(f"loader state: epoch and position must be integers >= 0, got {state!r}")
        if position > self._steps_in(epoch):
            raise ValueError(
                f"loader state: position {position} is past the {self._steps_in(epoch)} steps of epoch {epoch}; "
                "the data, train.global_batch_size or data.shift_windows changed since the checkpoint was written"
            )
        self.epoch, self.position = epoch, position


def eval_batches(
    dataset: TokenWindows,
    batch_size: int,
    num_batches: int,
    rank: int = 0,
    world_size: int = 1,
) -> list[torch.Tensor]:
    """This rank's share of the first ``num_batches`` global evaluation batches, in order.

    ``batch_size`` is the *global* batch: global batch ``b`` is windows
    ``[b*batch_size, (b+1)*batch_size)`` of ``dataset`` (no shuffling) and rank
    ``r`` gets the contiguous slice ``[r*B/W, (r+1)*B/W)`` of it, so the ranks'
    windows are disjoint and their union does not depend on the layout. Every
    rank gets the same number of batches (collectives inside the model stay
    matched). ``num_batches <= 0`` or more than fit means every complete batch.
    """
    if batch_size < 1 or batch_size % world_size:
        raise ValueError(
            f"evaluation batch size ({batch_size}) must be a positive multiple of the data-parallel size ({world_size})"
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
    available = len(dataset) // batch_size
    if available == 0:
        raise DataError(
            f"{dataset.path}: holds {len(dataset)} windows, fewer than one evaluation batch ({batch_size}); "
            "raise data.val_fraction, or lower data.seq_len or the batch size"
        )
    n = available if num_batches <= 0 else min(num_batches, available)
    per_rank = batch_size // world_size
    out = []
    for b in range(n):
        start = b * batch_size + rank * per_rank
        out.append(dataset.rows(range(start, start + per_rank)))
    return out
