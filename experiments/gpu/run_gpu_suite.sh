#!/usr/bin/env bash
# The GPU checks in one command on an air-gapped GPU machine: CUDA tests, benchmarks, the gpu-scale comparison.
#
#   experiments/gpu/run_gpu_suite.sh [--bundle DIR] [--cpu-smoke] [--out DIR] [--budget-s N] [--work DIR]
#        [--wheelhouse DIR|none] [--target DIR] [--sizes S] [--stand-ins DIR] [--no-compare] [--suite|--no-suite]
#        [--tables T] [--min-step-s N] [-- BENCH ARGS]
#
# 1. installs the wheelhouse (--bundle DIR: DIR/wheelhouse; else --wheelhouse, default experiments/gpu/wheelhouse;
#    "none": nothing) into --target (default /tmp/cpdae-site) and puts the repository, then the target, on PYTHONPATH;
# 2. the suite, once per machine (skipped when --work holds suite.done from an earlier call on this machine;
#    --suite forces it, --no-suite skips it): pytest -m gpu tests/project/test_gpu.py, experiments/gpu/bench_gpu.py,
#    env.txt; on the GPU the tests get until 40% of --budget-s and the benchmarks until 80%, each at least
#    --min-step-s seconds (default 10), then the step is stopped (its process group) and the call goes on;
# 3. with --bundle: unpacks DIR/data.tar.xz (once: DIR/data, DIR/bm25) and runs the gpu-scale comparison
#       python -m experiments.paper --scale gpu --overlay DIR/overlay.json --work-dir WORK/paper ...
#    in the BACKGROUND (setsid: it outlives this command while the machine stays held), Tables 1-2 first, then
#    3, 4 and the coverage figure (--tables T: only those, e.g. 3,4,coverage in a run after the one that wrote
#    Tables 1-2: a fresh machine runs again the stages they need); a later call finds it running and waits for it, or, when it has stopped
#    unfinished, starts it again (every stage is cached in WORK: it continues). This command waits for it until
#    --budget-s seconds (default 540) have passed since its start, then packs what is there and returns (after
#    Tables 1-2, or the --tables pass, the chain runs experiments/studies/cls_geometry.py: results/cls_geometry.md);
# 4. packs into OUT (at most 8 files, each well under 16 MiB): status.json (what ran, the comparison's state),
#    suite.tar.gz (test XML and log, bench_*.json, logs), bench_gpu.md, env.txt, paper_gpu.tar.gz (tables, stage
#    records, selection, stage logs and metrics; no checkpoints), compare.log.
# --cpu-smoke: the same on the CPU with tiny sizes (tests with CPDAE_GPU_TEST_DEVICE=cpu, the benchmarks'
#    --cpu-smoke, the comparison at --sizes smoke unless --sizes is given, waited for until it ends).
# OUT defaults to $OUT, else experiments/results/gpu/<card>/suite (rename it by subject); WORK to /tmp/cpdae-gpu
# (it survives between calls only while the GPU machine stays warm). Exit status: non-zero if a step failed (1) or
# bad usage (2, 3); 0 while the comparison is still running.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
START=$(date +%s)
WHEELHOUSE=""
TARGET=/tmp/cpdae-site
OUTDIR="${OUT:-}"
WORK=/tmp/cpdae-gpu
BUNDLE=""
BUDGET=540
SIZES=""
STAND_INS=""
SUITE=auto
COMPARE=1
TABLES=""
SMOKE=0
MIN_STEP=10
BENCH_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-smoke) SMOKE=1 ;;
    --bundle) BUNDLE="$2"; shift ;;
    --wheelhouse) WHEELHOUSE="$2"; shift ;;
    --target) TARGET="$2"; shift ;;
    --out) OUTDIR="$2"; shift ;;
    --work) WORK="$2"; shift ;;
    --budget-s) BUDGET="$2"; shift ;;
    --sizes) SIZES="$2"; shift ;;
    --stand-ins) STAND_INS="$2"; shift ;;
    --suite) SUITE=1 ;;
    --no-suite) SUITE=0 ;;
    --no-compare) COMPARE=0 ;;
    --tables) TABLES="$2"; shift ;;
    --min-step-s) MIN_STEP="$2"; shift ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "run_gpu_suite.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$MIN_STEP" in ''|*[!0-9]*) echo "run_gpu_suite.sh: --min-step-s takes whole seconds, got '$MIN_STEP'" >&2; exit 2 ;; esac
if [ -z "$OUTDIR" ]; then
  CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | tr 'A-Z' 'a-z' \
    | sed 's/^nvidia //; s/[^a-z0-9]\+/_/g; s/^_//; s/_$//')
  OUTDIR="$ROOT/experiments/results/gpu/${CARD:-cpu}/suite"
fi
mkdir -p "$OUTDIR" "$WORK"
OUTDIR="$(cd "$OUTDIR" && pwd)"
WORK="$(cd "$WORK" && pwd)"
cd "$ROOT"
if [ -n "$BUNDLE" ]; then
  [ -f "$BUNDLE/overlay.json" ] || { echo "run_gpu_suite.sh: --bundle $BUNDLE holds no overlay.json: build it with" \
    "experiments/gpu/build_bundle.py where PyPI and ../shared/data are, and carry it" >&2; exit 2; }
  BUNDLE="$(cd "$BUNDLE" && pwd)"
  [ -n "$WHEELHOUSE" ] || WHEELHOUSE="$BUNDLE/wheelhouse"
  [ -d "$WHEELHOUSE" ] || WHEELHOUSE=none   # a bundle built with --wheelhouse none (the CPU dry run)
else
  COMPARE=0
fi
[ -n "$WHEELHOUSE" ] || WHEELHOUSE="$ROOT/experiments/gpu/wheelhouse"

if [ "$WHEELHOUSE" != none ]; then
  shopt -s nullglob
  wheels=("$WHEELHOUSE"/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "run_gpu_suite.sh: no wheels in $WHEELHOUSE: run experiments/gpu/build_wheelhouse.py (or build_bundle.py)" \
         "where PyPI is reachable and carry the folder, or pass --wheelhouse none" >&2
    exit 2
  fi
  if [ ! -f "$TARGET/.installed" ] || [ "$(cat "$TARGET/.installed")" != "$(ls "$WHEELHOUSE")" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" \
      "${wheels[@]}" || { echo "run_gpu_suite.sh: installing $WHEELHOUSE into $TARGET failed" >&2; exit 3; }
    ls "$WHEELHOUSE" >"$TARGET/.installed"
  fi
  export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
fi
# the working tree's code first (the wheel in the wheelhouse may be older than the tree), the wheels' packages next
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

status=0
bench=()
if [ "$SMOKE" = 1 ]; then
  export CPDAE_GPU_TEST_DEVICE=cpu
  bench=(--cpu-smoke)
  [ -n "$SIZES" ] || SIZES=smoke
fi
elapsed() { echo $(( $(date +%s) - START )); }
# On the GPU each suite step runs under a deadline (the tests until 40% of --budget-s, the benchmarks until 80%, at
# least --min-step-s seconds each), so that the packing below always runs before the device command's own limit kills
# everything unpacked. A step runs in its own process group and the whole group is stopped (children too: the
# benchmarks start a process per objective): SIGTERM, then SIGKILL to what is left 3 s later; then its log is printed.
deadline() {  # deadline PERCENT -> seconds left until PERCENT% of --budget-s (a day in --cpu-smoke)
  [ "$SMOKE" = 1 ] && { echo 86400; return; }
  local left=$(( BUDGET * $1 / 100 - $(elapsed) ))
  [ "$left" -lt "$MIN_STEP" ] && left=$MIN_STEP
  echo "$left"
}
run_until() {  # run_until SECONDS LOG CMD...: CMD's output into LOG, its process group stopped after SECONDS
  local secs=$1 log=$2 t=0 pid rc i
  shift 2
  setsid "$@" >"$log" 2>&1 </dev/null &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$t" -ge "$secs" ]; then
      echo "run_until: stopped after ${secs} s (the suite's deadline): $*" >>"$log"
      kill -TERM -- "-$pid" 2>/dev/null
      for i in $(seq 30); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done  # gone: no need to wait 3 s
      kill -KILL -- "-$pid" 2>/dev/null
      break
    fi
    sleep 1; t=$((t + 1))
  done
  wait "$pid"; rc=$?
  cat "$log"
  return "$rc"
}
SUITE_DIR="$WORK/suite"
suite_ran=0
if [ "$SUITE" = 1 ] || { [ "$SUITE" = auto ] && [ ! -f "$WORK/suite.done" ]; }; then
  rm -rf "$SUITE_DIR"; mkdir -p "$SUITE_DIR"
  echo "== pytest -m gpu ($(elapsed) s)" >&2
  run_until "$(deadline 40)" "$SUITE_DIR/gpu_tests.log" "$PY" -m pytest -m gpu tests/project/test_gpu.py -p no:cacheprovider -o addopts= -rs \
    -q --junitxml="$SUITE_DIR/gpu_tests.xml" || status=1
  echo "== bench_gpu.py ($(elapsed) s)" >&2
  run_until "$(deadline 80)" "$SUITE_DIR/bench_gpu.log" "$PY" experiments/gpu/bench_gpu.py --out "$SUITE_DIR" \
    "${bench[@]}" "${BENCH_ARGS[@]}" || status=1
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "mode: $([ "$SMOKE" = 1 ] && echo cpu-smoke || echo gpu)"
    echo "PYTHONPATH: ${PYTHONPATH:-}"
    # (-c, not a script on stdin: a launcher that runs `python -c` programs itself, as the tests' warm one, runs it)
    "$PY" -c "$(cat <<'EOF'
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
)"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    fi
    if [ "$WHEELHOUSE" != none ]; then echo "wheels: $(cd "$WHEELHOUSE" && ls *.whl | tr '\n' ' ')"; fi
  } >"$SUITE_DIR/env.txt" 2>&1 || status=1
  echo "$status" >"$WORK/suite.done"
  suite_ran=1
fi

# ------------------------------------------------------------------ the gpu-scale comparison (background)
CMP="$WORK/paper"
compare_state=off
if [ "$COMPARE" = 1 ]; then
  if [ ! -d "$BUNDLE/data" ] || [ ! -d "$BUNDLE/bm25" ]; then
    echo "== unpacking $BUNDLE/data.tar.xz ($(elapsed) s)" >&2
    tar -xJf "$BUNDLE/data.tar.xz" -C "$BUNDLE" || { echo "run_gpu_suite.sh: unpacking $BUNDLE/data.tar.xz failed" >&2; exit 3; }
  fi
  mkdir -p "$CMP"
  pid=""; [ -f "$CMP/compare.pid" ] && pid="$(cat "$CMP/compare.pid")"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    echo "== the comparison is running (process $pid); waiting for it ($(elapsed) s)" >&2
  elif [ -f "$CMP/compare.rc" ] && [ "$(cat "$CMP/compare.rc")" = 0 ]; then
    echo "== the comparison finished in an earlier call" >&2
  else
    args=(--scale gpu --overlay "$BUNDLE/overlay.json" --work-dir "$CMP/work" --out "$CMP/results")
    [ -n "$SIZES" ] && args+=(--sizes "$SIZES")
    [ -n "$STAND_INS" ] && args+=(--stand-ins "$STAND_INS")
    [ -n "$TABLES" ] && args+=(--tables "$TABLES")
    printf '%q ' "$PY" -m experiments.paper "${args[@]}" >"$CMP/command.txt"
    rm -f "$CMP/compare.rc"
    echo "== starting the comparison in the background ($(elapsed) s): $(cat "$CMP/command.txt")" >&2
    # with --tables: only those; else Tables 1-2 (the core) first, then everything (each pass continues from the
    # cached stages). After the first pass, the [CLS] geometry study on the MARCO sample's zero-shot indexes (it
    # builds those a --tables pass did not make); its failure fails the call like the comparison's
    geo=("$PY" "$ROOT/experiments/studies/cls_geometry.py" --indices "$CMP/work/indices/marco_eval/zero-shot"
         --build-from "$CMP/work" --corpus "beir:$CMP/work/data/marco_eval:train" --out "$CMP/results/cls_geometry.md")
    geo_cmd="echo '== cls_geometry' && $(printf '%q ' "${geo[@]}")"
    passes='"$@" --tables 1,2 && '"$geo_cmd"' && "$@"'
    [ -n "$TABLES" ] && passes='"$@" && '"$geo_cmd"
    setsid nohup bash -c "$passes"'; echo $? >"'"$CMP"'/compare.rc"' _ \
      "$PY" -m experiments.paper "${args[@]}" >>"$CMP/compare.log" 2>&1 </dev/null &
    echo $! >"$CMP/compare.pid"
    pid=$!
  fi
  while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ ! -f "$CMP/compare.rc" ]; do
    if [ "$SMOKE" = 0 ] && [ "$(elapsed)" -ge "$BUDGET" ]; then break; fi
    sleep 1
  done
  if [ -f "$CMP/compare.rc" ]; then
    if [ "$(cat "$CMP/compare.rc")" = 0 ]; then compare_state=finished; else compare_state=failed; status=1; fi
  elif [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    compare_state=running
  else
    compare_state=stopped; status=1
  fi
fi

# ------------------------------------------------------------------ pack (at most 8 files in OUT)
if [ -d "$SUITE_DIR" ]; then
  tar -czf "$OUTDIR/suite.tar.gz" -C "$WORK" suite
  for f in bench_gpu.md env.txt; do [ -f "$SUITE_DIR/$f" ] && cp "$SUITE_DIR/$f" "$OUTDIR/$f"; done
fi
if [ "$COMPARE" = 1 ]; then
  cp "$CMP/compare.log" "$OUTDIR/compare.log" 2>/dev/null
  (cd "$CMP" && find . \( -path ./work/indices -o -path ./work/irds -o -path ./work/data -o -name '.token_cache' \
       -o -name 'token_cache' -o -name 'checkpoint-*' \) -prune -o -type f \( -path './results/*' \
       -o -path './work/stages/*' -o -path './work/selection*' -o -regex '\./work/select/[^/]*\.json' -o -name '*.log' -o -name '*.csv' -o -name '*.txt' \
       -o -name 'select_*.json' -o -name 'run_config.json' -o -name 'training_args.json' \) -size -4M -print \
     | tar -czf "$OUTDIR/paper_gpu.tar.gz" -T -)
fi
"$PY" - "$OUTDIR/status.json" "$suite_ran" "$status" "$compare_state" "$(elapsed)" "$CMP" <<'EOF'
import json, sys, pathlib
out, suite_ran, status, state, wall, cmp_dir = sys.argv[1:]
cmp_dir = pathlib.Path(cmp_dir)
records = sorted(p.stem.replace("__", ":") for p in (cmp_dir / "work" / "stages").glob("*.json"))
json.dump({"suite_ran_this_call": suite_ran == "1", "exit_status": int(status), "comparison": state,
           "finished_stages": records, "wall_s": int(wall)}, open(out, "w"), indent=1)
EOF
echo "comparison: $compare_state; results in $OUTDIR: $(cd "$OUTDIR" && ls | tr '\n' ' ')" >&2
exit $status
