#!/usr/bin/env bash
# Multi-node megapar-train with torchrun (static rendezvous: node 0 hosts it).
#
# Run the same command on every node, changing NODE_RANK:
#   NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 MASTER_ADDR=node0.example MASTER_PORT=29500 \
#     launch/torchrun_multinode.sh --tp 8 --pp 2 --model gpt2-1.5b --data /data/corpus
#
# Rank order is tp fastest, then pp, then dp (--rank-order tp-pp-dp, the default): give a tp
# that divides NPROC_PER_NODE so tensor-parallel groups stay inside a node; dp (= world / (tp*pp))
# crosses nodes. With --rank-order tp-dp-pp (Megatron's) pp is outermost instead: only the
# point-to-point activations cross nodes and the dp gradient all-reduce stays inside one
# (needs tp*dp <= NPROC_PER_NODE for that). Extra torchrun flags can go
# in TORCHRUN_ARGS (e.g. TORCHRUN_ARGS="--max-restarts 0"). Signal every node's torchrun: one
# node's alone stops the job (the ranks save and exit 0), and the others wait 300 s in torch's
# exit barrier for it (torchrun has no flag to shorten that), then exit 0.
set -euo pipefail
die() { echo "torchrun_multinode.sh: error: $*" >&2; exit 2; }
number='^(0|[1-9][0-9]{0,5})$'  # decimal, no leading zero (bash reads 08 as octal), short
[ -n "${NNODES:-}" ] || die "set NNODES (number of nodes), e.g. NNODES=2 NODE_RANK=0 $0 ARGS"
[[ "$NNODES" =~ $number ]] && [ "$NNODES" -ge 1 ] || die "NNODES=$NNODES: give a number of nodes (1, 2, ...)"
if [ "$NNODES" = "1" ]; then NODE_RANK="${NODE_RANK:-0}"; fi  # one node: it is node 0
[ -n "${NODE_RANK:-}" ] || die "set NODE_RANK (0 .. $((NNODES - 1))), this node's place, on each node"
[[ "$NODE_RANK" =~ $number ]] && [ "$NODE_RANK" -lt "$NNODES" ] \
  || die "NODE_RANK=$NODE_RANK: give 0 .. $((NNODES - 1)) (NNODES=$NNODES)"
# no default: one process a node (torchrun's) would train on one GPU of each without a word
[ -n "${NPROC_PER_NODE:-}" ] || die "set NPROC_PER_NODE (processes a node, one per GPU: 8 on a node of 8 GPUs), the same on every node"
[[ "$NPROC_PER_NODE" =~ $number ]] && [ "$NPROC_PER_NODE" -ge 1 ] \
  || die "NPROC_PER_NODE=$NPROC_PER_NODE: give the processes (GPUs) per node as a number (1, 2, ...; nvidia-smi -L lists a node's GPUs)"
if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  # 127.0.0.1 would make each node wait 600 s for a rendezvous on itself
  die "set MASTER_ADDR to node 0's address, the same on every node (MASTER_ADDR=127.0.0.1 only when all $NNODES nodes run on this machine)"
fi
: "${MASTER_ADDR:=127.0.0.1}"
: "${MASTER_PORT:=29500}"
[[ "$MASTER_PORT" =~ $number ]] && [ "$MASTER_PORT" -ge 1 ] && [ "$MASTER_PORT" -le 65535 ] \
  || die "MASTER_PORT=$MASTER_PORT: give a port (1 .. 65535), the same on every node"
if [[ "$MASTER_ADDR" =~ ^[^:]+:[0-9]+$ ]]; then  # host:port (an IPv6 address has more colons)
  die "MASTER_ADDR=$MASTER_ADDR: give the address alone (MASTER_ADDR=${MASTER_ADDR%:*}) and the port as MASTER_PORT=${MASTER_ADDR##*:}"
fi
if command -v getent > /dev/null && ! getent ahosts "$MASTER_ADDR" > /dev/null; then
  # torchrun repeated "The IPv6 network addresses of (node0, 29500) cannot be retrieved" until
  # its rendezvous timeout
  die "MASTER_ADDR=$MASTER_ADDR: this node cannot resolve that name; give node 0's address as every node reaches it (its IP, or a name in DNS or /etc/hosts)"
fi
if [ "$NODE_RANK" = 0 ] && timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$MASTER_PORT" 2> /dev/null; then
  # node 0 hosts the rendezvous there: torchrun's EADDRINUSE traceback (two jobs on one node)
  die "MASTER_PORT=$MASTER_PORT is in use on this node (another job's rendezvous?); give another port, the same on every node (MASTER_PORT=$((MASTER_PORT < 65535 ? MASTER_PORT + 1 : MASTER_PORT - 1)))"
fi
PYTHON="${PYTHON:-python3}"
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" ${TORCHRUN_ARGS:-} \
  -m megapar.cli.train "$@"
