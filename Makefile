# smolcluster: provision, measure, plan and train across a few mismatched machines.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
INVENTORY ?= inventory/hosts.yml
STAMP := $(VENV)/.smol-installed
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: setup system-deps test test-unit test-process test-sim test-provision demo provision verify matrix sim-up sim-down lint check-inventory clean

setup: $(STAMP)

# The Python that makes the venv: 3.11+ (the pinned numpy and ansible-core need it).
PYTHON ?= python3
# torch's CPU build on x86-64 Linux, where PyPI's default is the multi-GB CUDA one. auto: PyTorch's
# CPU index unless pip already has its own source (PIP_FIND_LINKS, PIP_INDEX_URL, a pip.conf
# find-links or index: a local wheel or a mirror); TORCH_INDEX= for none, TORCH_INDEX=URL for another.
TORCH_INDEX ?= auto

# Reinstall only when the project's declared dependencies change.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || bash scripts/make-venv.sh "$(PYTHON)" "$(VENV)"
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt $$(bash scripts/torch-index.sh "$(TORCH_INDEX)" "$(BIN)/pip") -e '.[dev]'
	@touch $(STAMP)

# The Debian packages the sim, probes and playbooks drive: apt as root, else the exact command, exit 2.
system-deps:
	@bash scripts/system-deps.sh

# Two workers: every sim file and playbook on the sim on one (fixed namespace names; SIM_FILES in tests/conftest.py),
# the other files spread over both, each on one worker; then the tests that hold measured rates to a truth, alone (QUIET in
# tests/conftest.py). Both phases always run; either failing fails the target.
test: system-deps setup
	@rc=0; \
	$(BIN)/pytest -q -ra --durations=20 -n 2 -m "not quiet" || rc=$$?; \
	$(BIN)/pytest -q -ra --durations=5 -m quiet || rc=$$?; \
	exit $$rc

# One tier at a time (markers assigned in tests/conftest.py): unit < process < sim < provision.
test-unit: setup
	$(BIN)/pytest -q -ra -m unit

test-process test-sim test-provision: test-%: system-deps setup
	$(BIN)/pytest -q -ra -m $*

demo: system-deps setup
	$(BIN)/smoltrain demo $(DEMO_ARGS)

check-inventory:
	@test -f "$(INVENTORY)" || { echo "error: $(INVENTORY) not found; copy inventory/hosts.example.yml to $(INVENTORY) and edit it (or use INVENTORY=inventory/sim.yml after 'make sim-up')" >&2; exit 2; }

# ASK_BECOME=1: ask for the sudo password once (-K), for hosts without passwordless sudo.
BECOME_ARGS := $(if $(filter 1 yes true,$(ASK_BECOME)),--ask-become-pass)

provision: setup check-inventory
	$(BIN)/ansible-playbook -i $(INVENTORY) $(BECOME_ARGS) playbooks/site.yml

verify: setup check-inventory
	$(BIN)/ansible-playbook -i $(INVENTORY) $(BECOME_ARGS) playbooks/verify.yml

matrix: setup check-inventory
	$(BIN)/smolnet matrix -i $(INVENTORY)

sim-up: setup
	$(BIN)/smolnet sim up

sim-down: setup
	$(BIN)/smolnet sim down

# The gates: ruff (lint and format), the import contracts in pyproject.toml, ansible-lint.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/ansible-lint playbooks/
	$(BIN)/ansible-playbook -i inventory/hosts.example.yml --syntax-check playbooks/site.yml playbooks/verify.yml playbooks/user.yml

clean:
	rm -rf $(VENV) .pytest_cache
