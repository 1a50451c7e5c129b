#!/usr/bin/env bash
# GPT-2 124M on one GPU in under 10 minutes: bf16, torch.compile, flash attention.
# `nanolab bench` prints tokens/s of nanolab and of the plain loop, MFU, the measured peak memory
# and the memory estimator's predicted peak beside it. A GPT-2-vocabulary dataset is used when
# DATA points at one; otherwise a BPE dataset of the same vocabulary size (50257) is made from the
# bundled corpus, which is all speed and memory need.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/bench_bpe50k}
MB=${MB:-16}        # micro-batch; `nanolab estimate --config configs/gpt2-124m.yaml --gpu <yours>`
[ -f "$DATA/meta.json" ] || nanolab prepare bundled:shakespeare --tokenizer bpe --bpe-vocab-size 50257 -o "$DATA"
nanolab bench --config configs/gpt2-124m.yaml --steps 150 --warmup 40 --rounds 2 \
  --set=--data.dataset_dir="$DATA" --set=--data.micro_batch_size="$MB" \
  --set=--run.global_batch_tokens=$((MB * 1024 * 2)) --set=--run.eval_every_steps=100 "$@"
