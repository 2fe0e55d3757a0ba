#!/usr/bin/env bash
# The GPU suite in one command, for an air-gapped GPU machine (issue 14).
#
#   experiments/gpu/run_gpu_suite.sh [--cpu-smoke] [--wheelhouse DIR] [--target DIR] [--out DIR] [-- BENCH ARGS]
#
# 1. installs the wheelhouse built by build_wheelhouse.py (default experiments/gpu/wheelhouse) into --target
#    (default /tmp/cpdae-site) with `pip install --no-index --no-deps --target` and puts it on PYTHONPATH;
#    "--wheelhouse none" installs nothing (the environment already has the packages, as in CI);
# 2. runs `pytest -m gpu tests/test_gpu.py` (junit XML + log into OUT);
# 3. runs experiments/gpu/bench_gpu.py (bench_encode/search/pretrain.json + bench_gpu.md into OUT);
# 4. writes env.txt (interpreter, GPU, versions, installed wheels) into OUT.
# --cpu-smoke: the same on the CPU with tiny sizes (the tests run with CPDAE_GPU_TEST_DEVICE=cpu).
# OUT defaults to $OUT, else experiments/results/gpu/<UTC time>. Exit status: non-zero if any step failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
WHEELHOUSE="$ROOT/experiments/gpu/wheelhouse"
TARGET=/tmp/cpdae-site
OUTDIR="${OUT:-}"
SMOKE=0
BENCH_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --wheelhouse) WHEELHOUSE="$2"; shift ;;
    --target) TARGET="$2"; shift ;;
    --out) OUTDIR="$2"; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "run_gpu_suite.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$OUTDIR" ] || OUTDIR="$ROOT/experiments/results/gpu/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
cd "$ROOT"

if [ "$WHEELHOUSE" != none ]; then
  shopt -s nullglob
  wheels=("$WHEELHOUSE"/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "run_gpu_suite.sh: no wheels in $WHEELHOUSE: run experiments/gpu/build_wheelhouse.py where PyPI is" \
         "reachable and carry the folder, or pass --wheelhouse none" >&2
    exit 2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" \
    "${wheels[@]}" || { echo "run_gpu_suite.sh: installing $WHEELHOUSE into $TARGET failed" >&2; exit 3; }
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

status=0
bench=()
if [ "$SMOKE" = 1 ]; then
  export CPDAE_GPU_TEST_DEVICE=cpu
  bench=(--cpu-smoke)
fi

echo "== pytest -m gpu" >&2
"$PY" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -rs -q --junitxml="$OUTDIR/gpu_tests.xml" \
  2>&1 | tee "$OUTDIR/gpu_tests.log" || status=1

echo "== bench_gpu.py" >&2
"$PY" experiments/gpu/bench_gpu.py --out "$OUTDIR" "${bench[@]}" "${BENCH_ARGS[@]}" 2>&1 \
  | tee "$OUTDIR/bench_gpu.log" || status=1

{
  echo "date: $(date -u +%FT%TZ)"
  echo "mode: $([ "$SMOKE" = 1 ] && echo cpu-smoke || echo gpu)"
  echo "PYTHONPATH: ${PYTHONPATH:-}"
  "$PY" - <<'EOF'
import importlib.metadata as md, platform, sys
import torch
print("python:", sys.version.split()[0], platform.machine())
print("torch:", torch.__version__, "cuda:", torch.version.cuda,
      "gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("pyterrier-cpdae", "pyterrier", "pyterrier-alpha", "npids", "ir-datasets", "ir-measures", "transformers",
             "sentence-transformers", "accelerate", "numpy", "pandas", "faiss-gpu-cu12", "faiss-cpu"):
    found = [f"{d.version} ({d.locate_file('')})" for d in md.distributions(name=name)]
    print(f"{name}: {'; '.join(found) if found else 'not installed'}")
print("pyterrier.artifact entry points:",
      sorted(e.name for e in md.entry_points(group="pyterrier.artifact") if e.value.startswith("pyterrier_cpdae")))
EOF
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  fi
  if [ "$WHEELHOUSE" != none ]; then echo "wheels: $(cd "$WHEELHOUSE" && ls *.whl | tr '\n' ' ')"; fi
} >"$OUTDIR/env.txt" 2>&1 || status=1

echo "results in $OUTDIR: $(cd "$OUTDIR" && ls | tr '\n' ' ')" >&2
exit $status
