bash benchmarks/gpu_session.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_CACHE_DIR=/tmp/triton-cache
A="--quant-sweep --quant-shapes 16,16,32768;16,64,32768 --quant-grans head --quant-formats float8_e4m3fn --quant-variants 128,4,3,2,1 --warm-workers 8 --deadline-s 70"
timeout 80 python3 benchmarks/triton_paged_check.py $A --json $OUT/a.json > $OUT/a.txt 2>&1; grep -E "^quant" $OUT/a.txt | cut -c1-200
timeout 80 python3 benchmarks/triton_paged_check.py $A --quant-base-env JAXATTN_TRITON_K_WIDEN=1 --json $OUT/b.json > $OUT/b.txt 2>&1; grep -E "^quant" $OUT/b.txt | cut -c1-200
