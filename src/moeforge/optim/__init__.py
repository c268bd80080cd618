"""Optimizer update rules and learning-rate schedules; they know no ranks."""
