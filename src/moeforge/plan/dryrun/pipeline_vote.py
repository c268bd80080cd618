"""The pipeline schedule's warm-up vote, taken by the one rank a dry run runs.

torch's schedules start with a vote among the stages (each says whether its
metadata is complete, the product travels to the last stage and back) and read
the result on the host. A dry run runs one rank at a time on a fake process
group: the peers' messages never come and fake tensors cannot be read. moeforge
gives every stage complete input and output metadata, so each stage's own vote
is the vote's outcome; this takes it locally, with no messages and no read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.distributed.pipelining import schedules
from torch.distributed.pipelining._utils import InferenceMode


def _local_vote(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
    dynamic = any(InferenceMode.needs_dynamic(s._user_meta, has_backward) for s in stages)
    for stage in stages:
        stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC


@contextlib.contextmanager
def pipeline_vote_alone() -> Iterator[None]:
    """Within the block, every pipeline schedule decides its warm-up vote from this rank's stages alone."""
    base = schedules._PipelineSchedule
    vote = base._warmup_p2p
    base._warmup_p2p = _local_vote  # type: ignore[method-assign]
    try:
        yield
    finally:
        base._warmup_p2p = vote  # type: ignore[method-assign]
