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

# Reinstall only when the project's declared dependencies change.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

# The Debian packages the sim, probes and playbooks drive: apt as root, else the exact command, exit 2.
system-deps:
	@bash scripts/system-deps.sh

test: system-deps setup
	$(BIN)/pytest -q -ra --durations=25

# One tier at a time (markers assigned in tests/conftest.py): unit < process < sim < provision.
test-unit: setup
	$(BIN)/pytest -q -ra -m unit

test-process test-sim test-provision: test-%: system-deps setup
	$(BIN)/pytest -q -ra -m $*

demo: system-deps setup
	$(BIN)/smoltrain demo $(DEMO_ARGS)

check-inventory:
	@test -f "$(INVENTORY)" || { echo "error: $(INVENTORY) not found; copy inventory/hosts.example.yml to $(INVENTORY) and edit it (or use INVENTORY=inventory/sim.yml after 'make sim-up')" >&2; exit 2; }

provision: setup check-inventory
	$(BIN)/ansible-playbook -i $(INVENTORY) playbooks/site.yml

verify: setup check-inventory
	$(BIN)/ansible-playbook -i $(INVENTORY) playbooks/verify.yml

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
	$(BIN)/ansible-playbook -i inventory/hosts.example.yml --syntax-check playbooks/site.yml playbooks/verify.yml

clean:
	rm -rf $(VENV) .pytest_cache
