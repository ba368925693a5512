#!/usr/bin/env bash
# On a GPU machine: install the peers (FlashInfer, from .peers/), then run each step given,
# appending every step's output to LOG_DIR/run.log.
#   bash benchmarks/gpu_run.sh LOG_DIR "pytest tests/test_merge.py" "bench bench_merge --quick" ...
# A step is "pytest ARGS..." (the gpu-marked tests run here), "bench MODULE ARGS..."
# (python -m benchmarks.MODULE) or "cli ARGS..." (the cascadeinfer command line). A step
# that runs past STEP_TIMEOUT_S seconds (if set) is stopped, and the next one runs. Steps run in order; a failing step does not stop the rest.
set -u
if [ $# -lt 1 ]; then echo "usage: bash benchmarks/gpu_run.sh LOG_DIR STEP..." >&2; exit 2; fi
LOG_DIR="$1"; shift
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1
if ls .peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peers/*.whl &&
  python3 -c "import glob, tarfile; tarfile.open(glob.glob('.peers/*.tar.xz')[0]).extractall('/tmp/site')" &&
  export FLASHINFER_WORKSPACE_BASE=/tmp/fiws FLASHINFER_CUDA_ARCH_LIST=9.0a
fi
export PYTHONPATH="$PWD:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
[ "$(nvidia-smi -L | wc -l)" -gt 1 ] && nvidia-smi topo -m
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
status=0
limit="timeout --kill-after=10 ${STEP_TIMEOUT_S:-0}"
for step in "$@"; do
  echo "=== $step"
  start=$(date +%s)
  set -- $step
  kind=$1; shift
  case "$kind" in
    pytest) $limit python3 -m pytest -q -x -p no:cacheprovider "$@" >"$LOG_DIR/step.log" 2>&1 ;;
    bench) mod=$1; shift; $limit python3 -m "benchmarks.$mod" "$@" >"$LOG_DIR/step.log" 2>&1 ;;
    cli) $limit python3 -m cascadeinfer.engine.cli "$@" >"$LOG_DIR/step.log" 2>&1 ;;
    *) echo "unknown step kind $kind" >"$LOG_DIR/step.log"; false ;;
  esac
  rc=$?
  [ $rc -ne 0 ] && status=1
  cat "$LOG_DIR/step.log" >>"$LOG_DIR/run.log"
  tail -n 40 "$LOG_DIR/step.log"
  echo "=== rc=$rc in $(( $(date +%s) - start )) s"
done

rm -f "$LOG_DIR/step.log"
exit $status
