#!/usr/bin/env bash
# The pip arguments that select torch's CPU build: `--extra-index-url URL`, or nothing.
#   torch-index.sh SETTING PIP
# SETTING is the Makefile's TORCH_INDEX: empty (nothing), a URL (that index), or auto: PyTorch's
# CPU index on x86-64 Linux (where PyPI's torch is the multi-GB CUDA build), unless pip already
# has a source of its own (PIP_FIND_LINKS, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, or a find-links or
# index in pip's configuration: a local wheel or a mirror), which then serves torch as it is.
# aarch64 (Pi 5) and macOS get their CPU/MPS build from PyPI itself.
set -uo pipefail
setting="${1-auto}" pip="${2:-pip}"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
case "$setting" in
  "") exit 0 ;;
  auto) ;;
  *) echo "--extra-index-url $setting"; exit 0 ;;
esac
[[ "$(uname -s)" == Linux && "$(uname -m)" == x86_64 ]] || exit 0
if [[ -n "${PIP_FIND_LINKS:-}${PIP_INDEX_URL:-}${PIP_EXTRA_INDEX_URL:-}" ]]; then
  exit 0
fi
if "$pip" config list 2>/dev/null | grep -qE '^[^=]*\.(find-links|index-url|extra-index-url)='; then
  exit 0
fi
echo "--extra-index-url $CPU_INDEX"
