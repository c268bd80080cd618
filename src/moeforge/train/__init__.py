"""Training: the loop, schedules, checkpoints, metrics and sampling."""
