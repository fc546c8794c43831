#!/usr/bin/env bash
# Multi-node launch with torchrun: run this script once on every node, with the same RUN_DIR.
#
#   # node 0 of 2 (node0 is reachable from node1):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash recipes/launch/torchrun.sh recipe=llama13b
#   # node 1 of 2:
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash recipes/launch/torchrun.sh recipe=llama13b
#
# torchrun starts NPROC_PER_NODE processes per node and sets RANK, LOCAL_RANK, WORLD_SIZE,
# MASTER_ADDR and MASTER_PORT; Lightning's TorchElasticEnvironment reads them and does not
# relaunch. trainer.devices and trainer.num_nodes are set to match. Extra arguments are Hydra
# overrides (recipe=..., data.path=..., ckpt_path=last to resume in RUN_DIR).
set -euo pipefail

NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
# The same on every node (a shared filesystem); relaunching into it with ckpt_path=last resumes.
RUN_DIR="${RUN_DIR:-outputs/torchrun_${MASTER_ADDR}_${MASTER_PORT}}"
PYTHON="${PYTHON:-python}"

exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --node-rank="$NODE_RANK" \
    --master-addr="$MASTER_ADDR" \
    --master-port="$MASTER_PORT" \
    --module lightning_zero train \
    trainer.devices="$NPROC_PER_NODE" \
    trainer.num_nodes="$NNODES" \
    hydra.run.dir="$RUN_DIR" \
    "$@"
