"""``moeforge experiment``: training-quality experiments, each a set of ordinary runs and one results table.

``dense`` (MoE vs dense at equal active and equal total parameters), ``expert-lr``
(``optim.expert_lr_scale``), ``balance`` (aux loss vs bias balancing vs none) and
``gerrymander`` (aux loss improving while the per-rank load worsens). See docs/quality.md.
"""

from moeforge.experiment.results import summarize_run, write_results
from moeforge.experiment.runner import run_experiment
from moeforge.experiment.variants import EXPERIMENTS, Variant

__all__ = ["EXPERIMENTS", "Variant", "run_experiment", "summarize_run", "write_results"]
