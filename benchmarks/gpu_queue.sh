#!/usr/bin/env bash
# The GPU queue, one step per call: bash benchmarks/gpu_queue.sh STEP [OUT]
#   tests   - every kernel test compiled on the GPU
#   kernels - the ZipperEngine table at the Llama-3-8B linears, M = 1 ... 8192, against BF16 in one run
#   nan     - the NaN-propagating quantizers and range-checked decode kernels against their old forms
#   suite   - the throughput suite on the Llama-3-8B shapes, every method with a speed form (torchao's rows
#             eager and compiled without CUDA graphs, in their own run; torchao rows
#             need its wheel carried in .whl/; without it they are recorded as unavailable)
# Logs and records go to OUT (default ./results/gpu_queue); a short table is printed last.
set -uo pipefail
step=${1:?step}; out=${2:-results/gpu_queue}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
case $step in
  tests)
    timeout 420 python3 -m pytest -q -n 14 -m "not slow" -p no:benchmark -p no:cacheprovider --timeout=300 \
      tests/kernels 2>&1 | tee "$out/kernel_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -40 ;;
  kernels)
    python3 benchmarks/kernels/zipper.py --models llama3-8b --layers qkv,o,gate_up,down \
      --ms 1,4,16,64,128,256,512,2048,8192 --budgets 0,10 --out "$out/zipper" 2>&1 | tee "$out/zipper.log" | tail -60 ;;
  nan)
    python3 benchmarks/kernels/nan_guard.py 2>&1 | tee "$out/nan_guard.log" | tail -40 ;;
  suite)
    # the methods whose steps capture in CUDA graphs; torchao's do not, and a failed capture breaks the
    # process for the cells after it, so torchao runs in a process of its own without graphs (with BF16)
    python3 -m mosaicquant run --model llama-3-8b-shapes \
      --methods fp16,rtn,quarot,spinquant,resq,atom,mosaicquant,mosaicquant:budget=0 \
      --suites throughput \
      --device cuda --dtype bfloat16 --report --out "$out/suite" 2>&1 | tee "$out/suite.log" | tail -40
    python3 -m mosaicquant run --model llama-3-8b-shapes \
      --methods fp16,torchao:recipe=int8_dyn,torchao:recipe=int4_wo,torchao:recipe=int8_dyn:compile=true,torchao:recipe=int4_wo:compile=true \
      --suites throughput:cuda_graphs=false \
      --device cuda --dtype bfloat16 --report --out "$out/torchao" 2>&1 | tee "$out/torchao.log" | tail -20 ;;
  *) echo "unknown step $step (tests, kernels, nan, suite)"; exit 2 ;;
esac
