#!/usr/bin/env bash
# Make the project's venv with a Python new enough for the pinned dependencies, or refuse in
# one line (exit 2) naming what to install: `make setup` calls it.
#   make-venv.sh PYTHON VENV
set -uo pipefail
py="${1:-python3}" venv="${2:-.venv}"
need="3.11"
if ! command -v "$py" >/dev/null 2>&1; then
  echo "error: $py not found; smolcluster needs Python $need+ (Debian/Ubuntu: sudo apt-get install python3 python3-venv, or run scripts/bootstrap.sh)" >&2
  exit 2
fi
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "error: smolcluster needs Python $need+, but $py is $("$py" -V 2>&1); install Python $need or newer (Debian 12 and Ubuntu 24.04 ship it) and run: make setup PYTHON=python3.11" >&2
  exit 2
fi
if ! "$py" -m venv "$venv"; then
  rm -rf "$venv"  # a half-made venv would be taken for a working one next time
  echo "error: $py -m venv failed; on Debian/Ubuntu install the venv module: sudo apt-get install python3-venv" >&2
  exit 2
fi
