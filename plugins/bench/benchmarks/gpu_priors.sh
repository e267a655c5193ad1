#!/usr/bin/env bash
# The H200 run behind the shipped Hopper priors (docs/tuning.md, "Shipped priors"): on the GPU
# machine, with the wheels of benchmarks/gpu_wheels.sh in .whl/ (CONTRIBUTING.md, "Working on a
# GPU"), one shape per sequence bucket of each call class (D 64/128/256, causal and full, GQA 1
# and 4; plain, a causal window, a two-sided window, a soft cap), forward and forward+backward,
# cudnn, flash_attn2 and mosaic_flash side by side, and auto as a fresh install ranks it (an
# empty tuning cache). Then `python plugins/bench/benchmarks/gpu_priors.py $OUT/*.json --write` here turns
# the JSON into the plugins' priors/hopper.json; the run itself installs them and times untuned
# auto with them at S 2k and 8k (verify.json). Usage: OUT=... bash plugins/bench/benchmarks/gpu_priors.sh
#
# `--gaps` (about 5 minutes): only the call classes that run left without priors, one shape per
# bucket that decides: D 256 (16 heads) at S 1k, 4k and 16k, full and causal, a causal window,
# a two-sided window and a soft cap at 4k and 16k; D 64 at S 16k (plain and both windows); D 64
# with a soft cap at 4k and 16k. Then `python plugins/bench/benchmarks/gpu_priors.py
# $OUT/gaps-*.json --merge --write` here adds them to the shipped priors.
set -uo pipefail
GAPS=0
[ "${1:-}" = "--gaps" ] && GAPS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS:-.whl}"/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 JAXATTN_CACHE_DIR=/tmp/jaxattn-cache-$$
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
IMPLS=${IMPLS:-cudnn,flash_attn2,mosaic_flash}
run() {  # NAME BUDGET_S ARGS...: one bench run, its table and JSON under $OUT
  local name=$1 budget=$2
  shift 2
  echo "== $name: jaxattn bench $* (budget $budget s)" | tee -a "$OUT/bench.log"
  python3 -m jaxattn bench --plain --progress plain --impls "$IMPLS" --repeats "${REPEATS:-6}" \
    --time-budget "$budget" --json "$OUT/$name.json" "$@" >> "$OUT/bench.txt" 2>> "$OUT/bench.log"
  grep -E "^auto vs|more than|within" "$OUT/bench.txt" | tail -n 3
}
if [ "$GAPS" = 1 ]; then
  D256="--shape 16,1024,16,256 --shape 4,4096,16,256 --shape 1,16384,16,256"
  LONG="--shape 4,4096,16,256 --shape 1,16384,16,256"
  # shellcheck disable=SC2086  # the shape lists split into words on purpose
  run gaps-plain "${PLAIN_S:-70}" $D256 --shape 1,16384,32,64
  # shellcheck disable=SC2086
  run gaps-window "${WINDOW_S:-40}" $LONG --shape 1,16384,32,64 --mask causal --window 1024,0
  # shellcheck disable=SC2086
  run gaps-twosided "${TWOSIDED_S:-30}" $LONG --shape 1,16384,32,64 --mask full --window 512
  # shellcheck disable=SC2086
  run gaps-softcap "${SOFTCAP_S:-70}" $LONG --shape 4,4096,32,64 --shape 1,16384,32,64 --soft-cap 30
  exit 0
fi
run plain "${PLAIN_S:-150}" --head-dims 128,64,256 --seqs 1k,4k,16k --gqa 4 --gqa-head-dims 128
run window "${WINDOW_S:-55}" --head-dims 128,64,256 --seqs 4k,16k --gqa 4 --gqa-head-dims 128 \
  --mask causal --window 1024,0
run twosided "${TWOSIDED_S:-35}" --head-dims 128,64,256 --seqs 4k,16k --gqa 1 --mask full --window 512
run softcap "${SOFTCAP_S:-90}" --head-dims 128,64,256 --seqs 4k,16k --gqa 4 --gqa-head-dims 128 --soft-cap 30
# Then the priors from these figures, installed, and untuned auto with them on sequence
# lengths none of the runs measured (a fresh tuning cache: priors and declared priority only).
python3 "${SCRIPTS:-plugins/bench/benchmarks}/gpu_priors.py" "$OUT"/{plain,window,twosided,softcap}.json --write --into /tmp/site
export JAXATTN_CACHE_DIR=/tmp/jaxattn-cache-verify-$$
run verify "${VERIFY_S:-80}" --head-dims 128,64 --seqs 2k,8k --gqa 4 --gqa-head-dims 128
