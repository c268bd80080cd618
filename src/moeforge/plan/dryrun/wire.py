"""Bytes one rank puts on the wire for a collective, with ring / pairwise algorithms (as ``moeforge plan``).

A group of ``g`` ranks: all-gather and reduce-scatter send ``(g - 1) / g`` of the whole buffer, all-reduce
twice that (a reduce-scatter and an all-gather), an all-to-all every row but those a rank keeps (under the
dry run's balanced splits ``(g - 1) / g`` of what it sends), broadcast and scatter at most the buffer.
"""

from __future__ import annotations


def wire_bytes(op: str, group: int, in_bytes: int, out_bytes: int) -> float:
    """What one rank sends for ``op`` over a group of ``group`` ranks (``in_bytes`` handed in, ``out_bytes``
    got back, as :class:`~moeforge.plan.dryrun.collectives.Collective` records them)."""
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    name = op.lower()
    if "all_to_all" in name or "alltoall" in name:
        return share * in_bytes
    if "allreduce" in name or "all_reduce" in name:
        return 2 * share * in_bytes
    if "gather" in name:
        return share * out_bytes
    if "reduce_scatter" in name:
        return share * in_bytes
    if name.startswith("send") or name.startswith("broadcast") or name.startswith("scatter"):
        return float(in_bytes)
    return 0.0
