#!/bin/sh
# The first line on a bare Debian/Ubuntu controller, run from the checkout:
#   sh scripts/bootstrap.sh
# installs what `make` needs before it can run (make, git, python3 with its venv module, the CA
# certificates pip needs), then the project's system packages (scripts/system-deps.sh) and its
# pinned .venv (`make setup`). As root it runs apt itself; otherwise through sudo.
# Refuses in one line (exit 2) where there is no apt or the Python is older than 3.11.
set -eu
cd "$(dirname "$0")/.."
if ! command -v apt-get >/dev/null 2>&1; then
  echo "bootstrap: no apt-get here; on another system install make, git and Python 3.11+ with venv, then run: make setup" >&2
  exit 2
fi
if [ "$(id -u)" = 0 ]; then
  as_root=""
elif command -v sudo >/dev/null 2>&1; then
  as_root="sudo"
else
  echo "bootstrap: not root and no sudo; run it as root: su -c 'sh scripts/bootstrap.sh'" >&2
  exit 2
fi
export DEBIAN_FRONTEND=noninteractive
$as_root apt-get update -qq
$as_root apt-get install -y -qq --no-install-recommends make git ca-certificates python3 python3-venv >/dev/null
$as_root env DEBIAN_FRONTEND=noninteractive bash scripts/system-deps.sh
make setup
echo "bootstrap: done; next: make demo (as root: the sim needs network namespaces)"
