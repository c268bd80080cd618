# The two set-up commands of the README. Each installs what it needs into .venv/ first.
.PHONY: demo test setup

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/torchrun --standalone --nproc-per-node 2 -m moeforge train configs/shakespeare.yaml --parallel.ep=2

test: setup
	.venv/bin/python -m pytest tests
