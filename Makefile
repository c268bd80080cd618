# The two set-up commands of the README. Each installs what it needs into .venv/ first.
.PHONY: demo test setup lock

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/moeforge train configs/shakespeare.yaml --nproc-per-node 2 --parallel.ep=2

test: setup
	.venv/bin/python -m pytest tests

# Re-pin every dependency (versions and sha256 hashes) into requirements.lock, which setup installs.
# torch stays out (setup.sh installs it first); its dependencies are resolved as the CPU build's.
lock: setup
	.venv/bin/python -m pip install -q pip-tools
	.venv/bin/pip-compile --quiet --strip-extras --generate-hashes \
	  --extra test --extra bench --extra tracking --extra lowp --extra docs --unsafe-package torch \
	  --no-emit-index-url --no-emit-find-links -o requirements.lock pyproject.toml scripts/lock-torch-cpu.in
