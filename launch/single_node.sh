#!/usr/bin/env bash
# Run an asyncrpc script on this machine under torchrun, loopback only.
#   launch/single_node.sh [NPROC] script.py [args...]     (NPROC defaults to 3)
set -euo pipefail
nproc=3
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; fi
[[ $# -ge 1 ]] || { echo "usage: $0 [NPROC] script.py [args...]" >&2; exit 2; }
exec asyncrpc-launch --nproc-per-node "$nproc" "$@"
