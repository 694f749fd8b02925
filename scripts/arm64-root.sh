#!/usr/bin/env bash
# An emulated arm64 Debian root with an aarch64 torch, for checking the Arm code paths on an x86
# machine (bench/bench_kleidiai.py): no Arm hardware was at hand, so qemu-user runs Arm's code.
#
#   scripts/arm64-root.sh build             make the root once (6-10 minutes), print its path
#   scripts/arm64-root.sh exec DIR CMD...   run CMD in the root, the tree at /src (read-only) and
#                                           DIR at /work, in a mount namespace of its own
#
# The root is debootstrap's (--foreign, its second stage under qemu-aarch64-static through
# binfmt_misc) with python3 and a venv at /opt/venv holding torch $TORCH (PyPI's aarch64 wheel,
# CPU only: from 2.11 on that wheel pulls in CUDA) and the project's dependencies from
# pyproject.toml. It is cached outside the repository (SMOL_TEST_CACHE, default
# /var/cache/smolcluster-tests, beside the fresh amd64 root of tests/freshroot.py); delete the
# directory to rebuild. Needs root: debootstrap, chroot, mounts, and binfmt_misc, where this script
# registers Debian's qemu-aarch64 entry (flag F: the interpreter is opened once, so it runs inside
# a chroot) when nothing is registered for aarch64 yet.
set -euo pipefail

TORCH=2.10.0
SUITE=bookworm
CACHE=${SMOL_TEST_CACHE:-/var/cache/smolcluster-tests}
ROOT="$CACHE/debian-$SUITE-arm64-torch$TORCH"
TREE=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "arm64-root: $*" >&2; exit 2; }

binfmt() {
  [[ "$(id -u)" == 0 ]] || die "needs root (debootstrap, chroot, binfmt_misc)"
  command -v qemu-aarch64-static >/dev/null || die "no qemu-aarch64-static: apt-get install qemu-user-static"
  local fs=/proc/sys/fs/binfmt_misc
  [[ -e $fs/register ]] || mount -t binfmt_misc binfmt_misc $fs || die "cannot mount binfmt_misc"
  if [[ ! -e $fs/qemu-aarch64 ]]; then
    local conf=/usr/lib/binfmt.d/qemu-aarch64.conf
    [[ -r $conf ]] || die "no $conf (Debian's qemu-user-static ships it)"
    cat "$conf" >$fs/register || die "cannot register qemu-aarch64 with binfmt_misc"
  fi
  grep -q '^enabled' $fs/qemu-aarch64 || die "binfmt_misc's qemu-aarch64 entry is disabled"
}

build() {
  binfmt
  if [[ -x "$ROOT/opt/venv/bin/python" ]]; then
    echo "$ROOT"
    return
  fi
  command -v debootstrap >/dev/null || die "no debootstrap: apt-get install debootstrap"
  local work="$ROOT.$$"
  trap 'rm -rf "$work"' EXIT
  mkdir -p "$CACHE"
  debootstrap --arch=arm64 --foreign --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$work" http://deb.debian.org/debian >&2
  chroot "$work" /debootstrap/debootstrap --second-stage >&2
  cp /etc/resolv.conf "$work/etc/resolv.conf"
  # this network's CA bundle: its proxy signs the mirrors' certificates
  cp /etc/ssl/certs/ca-certificates.crt "$work/etc/ssl/certs/ca-certificates.crt"
  local deps
  deps=$(python3 -c "import shlex, sys, tomllib; d = tomllib.load(open(sys.argv[1], 'rb'))['project']['dependencies'];
print(' '.join(shlex.quote(x) for x in d if not x.startswith('torch')))" "$TREE/pyproject.toml")
  # shellcheck disable=SC2086
  # a clean environment: this machine's PIP_* settings name its own paths
  chroot "$work" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root /bin/sh -c "python3 -m venv /opt/venv && \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt /opt/venv/bin/pip install -q --no-compile \
    --disable-pip-version-check torch==$TORCH $deps" >&2
  mv "$work" "$ROOT"
  trap - EXIT
  echo "$ROOT"
}

run() {
  local dir=$1
  shift
  binfmt
  [[ -x "$ROOT/opt/venv/bin/python" ]] || die "no root at $ROOT: run scripts/arm64-root.sh build"
  mkdir -p "$dir"
  # private mounts: they go when the command ends, and nothing in the cached root changes
  exec unshare --mount --propagation private /bin/sh -c '
    set -e; R=$1; T=$2; D=$3; shift 3
    mount -t proc proc "$R/proc"; mount --rbind /sys "$R/sys"; mount --rbind /dev "$R/dev"
    mkdir -p "$R/src" "$R/work"
    mount --bind -o ro "$T" "$R/src"; mount --bind "$D" "$R/work"
    exec chroot "$R" /usr/bin/env -i PATH=/opt/venv/bin:/usr/bin:/bin HOME=/work PYTHONPATH=/src \
      PYTHONDONTWRITEBYTECODE=1 QEMU_CPU="${QEMU_CPU:-max}" "$@"' sh "$ROOT" "$TREE" "$(cd "$dir" && pwd)" "$@"
}

case "${1:-}" in
  build) build ;;
  exec) [[ $# -ge 3 ]] || die "usage: scripts/arm64-root.sh exec DIR CMD..."; shift; run "$@" ;;
  *) die "usage: scripts/arm64-root.sh build | exec DIR CMD..." ;;
esac
