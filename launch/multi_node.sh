#!/usr/bin/env bash
# Run an asyncrpc script across several machines under torchrun: the command
# for ONE machine. Start it on every machine with the same MASTER_ADDR and
# MASTER_PORT and its own NODE_RANK (launch/ssh.sh does that over SSH):
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NPROC=4 \
#       IFACE=eth1 launch/multi_node.sh train.py --epochs 3
#
# MASTER_ADDR is an address of node 0 on the private network: node 0's store
# listens there only. IFACE (optional) is the interface RPC binds to on each
# node; by default, the one that routes to MASTER_ADDR.
set -euo pipefail
: "${NNODES:?set NNODES, the number of machines}"
: "${NODE_RANK:?set NODE_RANK, 0 on the machine at MASTER_ADDR}"
: "${MASTER_ADDR:?set MASTER_ADDR, node 0 address on the private network}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC=${NPROC:-1}
iface=()
if [[ -n "${IFACE:-}" ]]; then iface=(--interface "$IFACE"); fi
exec asyncrpc-launch --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --nproc-per-node "$NPROC" "${iface[@]}" "$@"
