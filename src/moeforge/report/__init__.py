"""``moeforge report RUN_DIR``: one self-contained HTML page of a run's metrics, config and environment.

Nothing in training imports this package; it only reads what a run directory holds
(``metrics.jsonl``, ``config.yaml``, ``env.json``).
"""

from moeforge.report.page import write_report
from moeforge.report.run_data import NoMetricsError, RunData, load_run

__all__ = ["NoMetricsError", "RunData", "load_run", "write_report"]
