bash benchmarks/gpu_session.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
N192=64,192,2,1,0,0,0,0,0,0,0,0,0,0,0
timeout 200 python3 benchmarks/mosaic_bench.py --ab 15 --config $N192 --shape 1,16384,32,8,128 --shape 1,16384,32,32,128 > $OUT/ab16k.txt 2>&1; grep -v WARNING $OUT/ab16k.txt | grep -E 'full|causal|mosaic|tokamax |cudnn' | cut -c1-200
MOSAIC_S=330 bash benchmarks/gpu_session.sh mosaic 2>&1 | grep -v WARNING
