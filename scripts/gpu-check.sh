#!/usr/bin/env bash
# The whole GPU check in one call (run through the `device` tool on the lent H200, or on any GPU box):
#   unit tests, nbval over every notebook, `python -m dsv4ref check`, `python -m dsv4ref bench`, and the
#   unit tests once more under compute-sanitizer memcheck. Writes logs and a short report to $OUT (or ./gpu-out).
#
# The H200 image has torch + triton but no jupyter/nbval and no network, so the notebook stack travels as
# wheels in .whl/ and is installed to /tmp/site. Fetch them first, on a machine with internet:
#   bash scripts/fetch_gpu_wheels.sh        (cp312 by default; PY=3.11 for another Python; PEERS=1 adds FlashMLA)
#
#   device run:  bash scripts/gpu-check.sh            (carry: [".whl"])
#   stages:      unit nbval check bench memcheck, moe_sweep gluon_sweep kv_sweep indexer_sweep mhc_sweep
#                (benchmarks/*.py), profile (ncu on the Gluon kernel), decode (the demo eager and graphed),
#                probe (PROBE=script), sass (ncu per-instruction stall samples, SASS_RUNS)
#   env knobs:   STAGES="unit nbval check bench memcheck"   UNIT_TESTS="tests/test_moe.py ..."   BENCH_OP="indexer sparse_mla"   MEMCHECK_TESTS=tests/test_kv_cache.py
#                LIMIT_UNIT=420 LIMIT_NBVAL=420 LIMIT_CHECK=300 LIMIT_BENCH=420 LIMIT_MEMCHECK=420 (seconds per stage)
#                WORKERS=8 DIST=loadfile (unit: pytest-xdist workers and scheduling; DIST=load spreads one big file,
#                e.g. tests/test_mhc.py's ~40 GPU candidate tests, over every worker instead of one)
#   nbval runs with DSV4REF_BENCH=0: the notebooks' benchmark cells (ignored by nbval) skip their timings.
set -uo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
STAGES=${STAGES:-"unit nbval check bench memcheck"}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD" || echo "wheel install failed"
else
  export PYTHONPATH="$PWD"
fi
REPORT="$OUT/report.md"
{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -m dsv4ref info
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) files changed"
  echo '```'
} > "$REPORT"

stage() {  # stage NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  echo "## $name: rc=$rc (${dt}s)" >> "$REPORT"
  echo '```' >> "$REPORT"
  tail -n "${TAIL:-25}" "$OUT/$name.log" >> "$REPORT"
  echo '```' >> "$REPORT"
  echo "$name rc=$rc ${dt}s"
}

# The GPU image has no notebook stack unless .whl/ brought it: skip the tests that need JupyterLab (not carried:
# test_lab.py starts a server) or jupytext.
NB_SKIP=""
python3 -c "import jupyterlab" 2>/dev/null || NB_SKIP="--ignore=tests/test_lab.py"
python3 -c "import jupytext" 2>/dev/null || NB_SKIP="$NB_SKIP --deselect tests/test_project.py::test_notebooks_match_their_sources"
python3 -c "import nbval" 2>/dev/null || echo "nbval is not installed: run scripts/fetch_gpu_wheels.sh and carry .whl/" | tee -a "$REPORT"

for s in $STAGES; do
  case $s in
    unit)     stage unit ${LIMIT_UNIT:-420} python3 -m pytest ${UNIT_TESTS:-tests} -v -o addopts="" -p no:cacheprovider -p no:benchmark \
                -n ${WORKERS:-8} --dist ${DIST:-loadfile} --tb=short -rfE $NB_SKIP ;;
    moe_sweep)   stage moe_sweep ${LIMIT_MOE_SWEEP:-150} python3 benchmarks/experiments/moe_sweep.py ;;
    gluon_sweep) stage gluon_sweep ${LIMIT_GLUON_SWEEP:-240} python3 benchmarks/experiments/sparse_mla_gluon.py ${GLUON_SWEEP_ARGS:-} ;;
    kv_sweep)    stage kv_sweep ${LIMIT_KV_SWEEP:-150} python3 benchmarks/experiments/${KV_SWEEP:-kv_cache_sweep.py} ;;
    indexer_sweep) stage indexer_sweep ${LIMIT_INDEXER_SWEEP:-150} python3 benchmarks/experiments/indexer_sweep.py ;;
    mhc_sweep)   stage mhc_sweep ${LIMIT_MHC_SWEEP:-180} python3 benchmarks/experiments/mhc/sweep.py ${MHC_SWEEP_ARGS:-} ;;
    profile)     stage profile ${LIMIT_PROFILE:-120} ncu --kernel-name regex:_ws_kernel --launch-skip 3 --launch-count 1 \
                   --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
                   python3 benchmarks/experiments/gluon_profile.py ${PROFILE_ARGS:-} ;;
    sass)     # per-instruction warp-stall samples (CSV, one file per kernel), for the kernels named in SASS_RUNS:
              # "tag|kernel regex|script args" items separated by ';'
              IFS=';' read -ra SASS_ITEMS <<< "${SASS_RUNS:-gluon_h128|_ws_kernel|benchmarks/experiments/gluon_profile.py 128 1152;gluon_h64|_ws_kernel|benchmarks/experiments/gluon_profile.py 64 640;mhc_pre|hc_one_pass|benchmarks/experiments/mhc/profile_run.py pre one-pass}"
              for item in "${SASS_ITEMS[@]}"; do
                IFS='|' read -r tag kre args <<< "$item"
                stage "sass_$tag" ${LIMIT_SASS:-120} ncu --kernel-name "regex:$kre" --launch-skip 3 --launch-count 1 \
                  --section SpeedOfLight --section WarpStateStats --section SourceCounters \
                  --section MemoryWorkloadAnalysis_Tables -f -o "$OUT/prof_$tag" python3 $args
                ncu --import "$OUT/prof_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$tag.csv" 2>&1 \
                  || echo "source page export failed for $tag" >> "$REPORT"
                ncu --import "$OUT/prof_$tag.ncu-rep" --page details > "$OUT/details_$tag.txt" 2>&1
                rm -f "$OUT/prof_$tag.ncu-rep"
              done ;;
    decode)   stage decode ${LIMIT_DECODE:-120} python3 -m dsv4ref demo --steps 16 --graph ;;
    nbval)    DSV4REF_BENCH=0 stage nbval ${LIMIT_NBVAL:-420} python3 -m pytest notebooks -q -o addopts="" -p no:cacheprovider --nbval --nbval-current-env \
                --nbval-sanitize-with notebooks/nbval_sanitize.cfg --nbval-cell-timeout 300 -n ${NBVAL_WORKERS:-0} ;;
    check)    stage check ${LIMIT_CHECK:-300} python3 -m dsv4ref check ;;
    bench)    TAIL=60 stage bench ${LIMIT_BENCH:-420} python3 -m dsv4ref bench --ladder "$OUT/sparse_mla_ladder.json" ${BENCH_OP:-} ;;
    probe)    stage probe ${LIMIT_PROBE:-60} python3 ${PROBE:-scripts/probe.py} ;;
    memcheck) stage memcheck ${LIMIT_MEMCHECK:-420} compute-sanitizer --tool memcheck --print-limit 20 --error-exitcode 3 \
                python3 -m pytest ${MEMCHECK_TESTS:-tests} -q -o addopts="" -p no:cacheprovider -p no:benchmark $NB_SKIP ;;
  esac
done
cat "$REPORT"
