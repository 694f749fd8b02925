#!/usr/bin/env bash
# The Debian/Ubuntu packages the sim, the probes, provisioning and the tests drive for real
# (gcc builds the decode kernels, smoltrain/models/kernels.c).
# Installed with apt when run as root; otherwise the exact command is printed and the exit
# status is 2, so `make demo` and `make test` stop instead of degrading silently.
#   --list    print the package names and exit
#   --check   exit 0 when all are installed, 2 otherwise (never installs)
# SMOL_SYSTEM_DEPS=skip skips the check (for non-Debian machines; said loudly).
set -euo pipefail

PACKAGES=(openssh-server openssh-client iperf3 iputils-ping ethtool iproute2 kmod
          nfs-ganesha nfs-ganesha-vfs libnfs-utils make gcc
          gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user  # the Arm kernels' tests (tests/test_kernels_c.py)
          clang  # a Mac-like build: clang without libomp (tests/test_backends.py)
          python3-venv  # make setup's `python3 -m venv`
          qemu-user-static  # bench/bench_kleidiai.py's emulated arm64 root (scripts/arm64-root.sh)
          mmdebstrap nftables  # the fresh-host provisioning test and the firewall role
          debootstrap  # bench/bench_kleidiai.py's arm64 root (scripts/arm64-root.sh)
          python3-apt)  # Ansible's apt module on the sim's hosts (they run this machine's python3)

if [[ "${1:-}" == "--list" ]]; then
  printf '%s\n' "${PACKAGES[@]}"
  exit 0
fi
if [[ "${SMOL_SYSTEM_DEPS:-}" == "skip" ]]; then
  echo "system-deps: SKIPPED the system package check (SMOL_SYSTEM_DEPS=skip): the sim, the probes and" \
       "provisioning may fail or be missing" >&2
  exit 0
fi
if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "system-deps: this is not a Debian/Ubuntu machine (no dpkg-query); install the equivalents of:" \
       "${PACKAGES[*]} — then rerun with SMOL_SYSTEM_DEPS=skip" >&2
  exit 2
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "system-deps: all ${#PACKAGES[@]} system packages are installed"
  exit 0
fi
cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [[ "${1:-}" == "--check" ]]; then
  echo "system-deps: missing ${missing[*]}; install with: sudo apt-get update && sudo $cmd" >&2
  exit 2
fi
if [[ "$(id -u)" != "0" ]]; then
  echo "system-deps: missing ${missing[*]}; not root, so install them yourself:" >&2
  echo "  sudo apt-get update && sudo $cmd" >&2
  echo "then run make again (or run make as root, which installs them)." >&2
  exit 2
fi
echo "system-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends ${missing[*]} >/dev/null
echo "system-deps: installed ${missing[*]}"
