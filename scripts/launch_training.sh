#!/usr/bin/env bash
# Start this node's share of a multi-node podtrain job. Run it once on every node:
#
#   WORLD_SIZE      processes in the whole job (nodes x NPROC_PER_NODE)
#   NODE_RANK       this node's index, 0 .. nodes-1
#   NPROC_PER_NODE  processes on this node (default 1: one process drives all local devices)
#   MASTER_ADDR     address of node 0 that every node can reach
#   MASTER_PORT     free port on node 0 for the JAX coordinator (default 29500)
#   PODTRAIN_MAX_RESTARTS  restarts of this node's processes after one dies (default 0; see `podtrain launch --help`)
#
#   scripts/launch_training.sh configs/llama_1b.yaml train.steps=1000   # `train` is implied
#   scripts/launch_training.sh doctor                                   # or name the command
#
# PODTRAIN overrides the command that runs podtrain (default: `podtrain`, else `python -m podtrain`).
set -euo pipefail

: "${WORLD_SIZE:?set WORLD_SIZE to the number of processes in the job}"
: "${NODE_RANK:?set NODE_RANK to the index of this node (0 on the node at MASTER_ADDR)}"
: "${MASTER_ADDR:?set MASTER_ADDR to an address of node 0 that every node can reach}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
MASTER_PORT="${MASTER_PORT:-29500}"

if (( WORLD_SIZE % NPROC_PER_NODE != 0 )); then
  echo "launch_training.sh: error: WORLD_SIZE=$WORLD_SIZE is not a multiple of NPROC_PER_NODE=$NPROC_PER_NODE; set WORLD_SIZE to nodes x NPROC_PER_NODE." >&2
  exit 2
fi

if [[ -z "${PODTRAIN:-}" ]]; then
  if command -v podtrain >/dev/null; then PODTRAIN=podtrain; else PODTRAIN="python3 -m podtrain"; fi
fi
case "${1:-}" in
  train|doctor|generate|plot) ;;
  *) set -- train "$@" ;;
esac

exec $PODTRAIN launch --nproc "$NPROC_PER_NODE" --nnodes "$((WORLD_SIZE / NPROC_PER_NODE))" --node-rank "$NODE_RANK" \
  --coordinator "$MASTER_ADDR:$MASTER_PORT" --max-restarts "${PODTRAIN_MAX_RESTARTS:-0}" -- "$@"
