#!/usr/bin/env bash
# LAMB with a large batch: gpt2-tiny on the shipped Shakespeare sample, global batch 256
# (16x the default), 2 data-parallel ranks x 2 tensor-parallel ranks with ZeRO-1.
# --lr-scale-with-batch 16 applies the linear scaling rule: the peak LR becomes
# 1e-3 x 256 / 16 = 1.6e-2, reached after a 10-step warmup (LAMB's per-layer trust ratio
# keeps every layer's step proportional to its weight norm, which is what makes this stable).
# Extra flags are passed on and win over the ones below, e.g.
# `examples/lamb_large_batch.sh --max-steps 5`. The 10-step warmup is set only for the full
# 40-step run: with your own --max-steps (or --warmup-steps), megapar-train picks the warmup
# (10 % of --max-steps unless you give --warmup-steps).
set -euo pipefail
warmup=(--warmup-steps 10)
for arg in "$@"; do
    case "$arg" in
        --max-steps | --max-steps=* | --warmup-steps | --warmup-steps=*) warmup=() ;;
    esac
done
exec megapar-train --tp 2 --dp 2 --zero 1 --optimizer lamb --lr 1e-3 --min-lr 1e-4 \
    --lr-scale-with-batch 16 --global-batch-size 256 --micro-batch-size 16 --seq-len 64 \
    ${warmup[@]+"${warmup[@]}"} --max-steps 40 --log-interval 5 --eval-interval 20 "$@"
