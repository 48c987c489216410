#!/usr/bin/env bash
# Start an asyncrpc script on several machines over SSH: one asyncrpc-launch
# (torchrun) per machine, node ranks in the order of HOSTS, then wait for all.
#
#   HOSTS="10.0.0.1 10.0.0.2" NPROC=4 launch/ssh.sh train.py --epochs 3
#
# HOSTS   the machines' addresses on the private network; the first one hosts
#         the rendezvous store (it listens on that address only).
# NPROC   workers per machine (default 1); PORT the store's port (default 29500)
# IFACE   interface the workers' RPC binds to (default: the one routing to HOSTS[0])
# REMOTE_DIR  the checkout on every machine (default: this directory's path)
# ACTIVATE    a script to source first there, e.g. .venv/bin/activate
# SSH     the command that runs a command on a host (default: ssh -o BatchMode=yes)
#
# Every line of output is prefixed with its host; the exit code is the first
# non-zero one of the machines.
set -euo pipefail
[[ $# -ge 1 ]] || { sed -n '2,16p' "$0" >&2; exit 2; }
read -r -a hosts <<< "${HOSTS:?set HOSTS to the private addresses of the machines, rendezvous host first}"
port=${PORT:-29500}
nproc=${NPROC:-1}
dir=${REMOTE_DIR:-$PWD}
read -r -a ssh <<< "${SSH:-ssh -o BatchMode=yes}"
script=$(printf '%q ' "$@")

pids=()
for rank in "${!hosts[@]}"; do
    command="cd $(printf '%q' "$dir")"
    if [[ -n "${ACTIVATE:-}" ]]; then command+=" && . $(printf '%q' "$ACTIVATE")"; fi
    command+=" && exec asyncrpc-launch --nnodes ${#hosts[@]} --node-rank $rank"
    command+=" --rdzv-endpoint ${hosts[0]}:$port --nproc-per-node $nproc"
    if [[ -n "${IFACE:-}" ]]; then command+=" --interface $(printf '%q' "$IFACE")"; fi
    command+=" $script"
    "${ssh[@]}" "${hosts[$rank]}" "$command" 2>&1 | sed -u "s/^/[${hosts[$rank]}] /" &
    pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || { code=$?; [[ $status -ne 0 ]] || status=$code; }
done
exit "$status"
