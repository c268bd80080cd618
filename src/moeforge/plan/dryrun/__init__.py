"""``moeforge plan --dry-run``: the real trainer's build and steps under a fake process group and fake tensors.

:mod:`.collectives` records every collective a step issues (real gloo runs too), :mod:`.live_memory` counts
the bytes fake tensors would hold, :mod:`.rank` runs one rank, :mod:`.command` runs the chosen ranks and
reports them.
"""
