#!/usr/bin/env bash
# One GPU session's work, in stages, for the GPU machine (CONTRIBUTING.md, "Working on a GPU"): install
# the wheels built by benchmarks/gpu_wheels.sh (carried in .whl/), then run what a stage
# names, writing logs and JSON under $OUT. Usage: bash benchmarks/gpu_session.sh STAGE...
#   tests     the GPU tests of the dense and serving backends (cuDNN, Triton, serving)
#   paged     plugins/triton/benchmarks/triton_paged_check.py: numerics and bandwidth of the Triton paged kernels
#   sweep     plugins/triton/benchmarks/triton_paged_check.py --sweep: tiles and key splits of the paged kernel
#   serving   jaxattn bench --serving: every serving backend side by side (GB/s); SERVING_S budget,
#             SERVING_IMPLS backends
#   info      jaxattn info and jaxattn list (what is installed and usable on this machine)
#   dense     jaxattn bench on the D=128 flash targets (regression check of the dense kernels)
#   mosaic    the GPU tests of mosaic_flash (tests/mosaic), one line per test as it ends, so a
#             time limit still shows what failed; MOSAIC_S budget, MOSAIC_K a pytest -k filter
#   feature   plugins/mosaic/benchmarks/feature_bench.py --feature FEATURE (soft_cap or window, the default)
#   mosaic-bench  benchmarks/mosaic_bench.py --check --bench --bwd at D 128, 64 and 256 (MOSAIC_HEAD_DIMS), beside cuDNN
#             and tokamax (when gpu_wheels.sh ran with TOKAMAX=1)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
if [ -d .whl/peers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/peers/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 JAXATTN_CACHE_DIR=/tmp/jaxattn-cache
# Triton keeps compiled kernels under $HOME, which the GPU machine may not set: give it a place.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
for stage in "$@"; do
  start=$(date +%s)
  case "$stage" in
    tests)
      # Several test processes share the GPU: none may take most of its memory up front.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TESTS_S:-500}" python3 -m pytest -q -n 4 -p no:cacheprovider -m "gpu or not tpu" \
        tests/sdpa tests/triton tests/serving tests/core/test_paged.py \
        -k "gpu or Gpu or cudnn or Cudnn or paged or serving or decode or lengths or x64" \
        > "$OUT/gpu-tests.log" 2>&1
      tail -n 40 "$OUT/gpu-tests.log" ;;
    paged)
      python3 plugins/triton/benchmarks/triton_paged_check.py --check --bench --ragged --deadline-s 300 \
        --json "$OUT/triton_paged.json" > "$OUT/triton_paged.txt" 2>&1
      tail -n 60 "$OUT/triton_paged.txt" ;;
    sweep)
      python3 plugins/triton/benchmarks/triton_paged_check.py --sweep --deadline-s "${SWEEP_S:-300}" \
        --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1
      grep -E "sweep ps" "$OUT/sweep.txt" | sort -t: -k2 | head -n 120 ;;
    serving)
      # SERVING_IMPLS limits the backends (names or aliases); the JSON is rewritten per shape.
      python3 -m jaxattn bench --serving --plain --progress plain --time-budget "${SERVING_S:-450}" \
        ${SERVING_IMPLS:+--impls "$SERVING_IMPLS"} --json "$OUT/serving.json" > "$OUT/serving.txt" 2> "$OUT/serving.log"
      cut -c1-220 "$OUT/serving.txt" ;;
    dense)
      python3 -m jaxattn bench --head-dims 128 --seqs 4k,16k --gqa 4 --progress plain --time-budget 240 \
        --json "$OUT/bench.json" > "$OUT/bench.txt" 2> "$OUT/bench.log"
      cat "$OUT/bench.txt" | cut -c1-220 ;;
    info)
      { python3 -m jaxattn info; python3 -m jaxattn list; } > "$OUT/info.txt" 2>&1
      cut -c1-200 "$OUT/info.txt" ;;
    mosaic)
      # 8 processes: compiling the kernels is most of the time, and it runs on the CPU.
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${MOSAIC_S:-400}" python3 -m pytest -v -n 8 -p no:cacheprovider \
        -m "gpu or not tpu" --tb=short ${MOSAIC_K:+-k "$MOSAIC_K"} tests/mosaic > "$OUT/mosaic-tests.log" 2>&1
      grep -E "FAILED|^E " "$OUT/mosaic-tests.log" | cut -c1-300 | head -n 40
      tail -n 3 "$OUT/mosaic-tests.log" ;;
    mosaic-bench)
      timeout "${MOSAIC_BENCH_S:-540}" python3 benchmarks/mosaic_bench.py --check --bench --bwd --head-dims "${MOSAIC_HEAD_DIMS:-128,64,256}" \
        > "$OUT/mosaic-bench.txt" 2>&1
      grep -v WARNING "$OUT/mosaic-bench.txt" | grep -E "^\||FAIL|unavailable" | cut -c1-220 ;;
    feature)
      timeout "${FEATURE_S:-400}" python3 plugins/mosaic/benchmarks/feature_bench.py --feature "${FEATURE:-window}" > "$OUT/feature.txt" 2>&1
      grep -v WARNING "$OUT/feature.txt" | tail -n 12 | cut -c1-300 ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "stage $stage took $(( $(date +%s) - start )) s"
done
