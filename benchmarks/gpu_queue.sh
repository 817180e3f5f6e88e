#!/usr/bin/env bash
# The GPU queue, one step per call: bash benchmarks/gpu_queue.sh STEP [OUT]
#   tests   - every kernel test compiled on the GPU, and the harness's GPU tests (timing, floor)
#   check   - the harness's GPU tests alone
#   kernels - the ZipperEngine table at the Llama-3-8B linears, M = 1 ... 8192, against BF16 in one run
#   atom    - the mixed kernels' GPU tests (the whole decode step of atom/resq/spinquant under each chain mode, bit
#             for bit), then the mixed sweep below
#   atom_step - BF16, RTN and the mixed-precision methods' decode (batches 4, 32), and Atom's step profile
#   mixed   - Atom's decode kernels on the Llama-3-8B linears: the mixed quantizer's programs a token and a grid of
#             mixed-GEMM tiles, against RTN's GEMM and BF16 in one run
#   nan     - the NaN-propagating quantizers and range-checked decode kernels against their old forms
#   suite   - the throughput suite on the Llama-3-8B shapes, every method with a speed form under CUDA
#             graphs, then BF16 and torchao's eager rows without graphs (their steps do not capture)
#   torchao - torchao's compiled rows (torch.compile max-autotune) without graphs, batches 4 and 32
#   profile - where the decode step (batch 4, 32) and the prefill go, per kernel: RTN, MosaicQuant at budget 0
#             and 10 %, Atom
# torchao rows need its wheel carried in .whl/ (without it they are recorded as unavailable). Records
# go under OUT (default ./results/gpu_queue), which a warm machine keeps between calls: a step cut off
# by the call's limit resumes its finished cells when run again.
# Logs and records go to OUT (default ./results/gpu_queue); a short table is printed last.
set -uo pipefail
step=${1:?step}; out=${2:-results/gpu_queue}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
harness_gpu="tests/harness/test_timing.py tests/harness/test_floor.py"
case $step in
  tests)
    timeout 420 python3 -m pytest -q -n 14 -m "not slow" -p no:benchmark -p no:cacheprovider --timeout=300 \
      tests/kernels $harness_gpu 2>&1 | tee "$out/kernel_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -40 ;;
  check)
    timeout 300 python3 -m pytest -q -m gpu -p no:benchmark -p no:cacheprovider $harness_gpu 2>&1 \
      | tee "$out/harness_gpu_tests.log" | tail -15 ;;
  kernels)
    python3 benchmarks/kernels/zipper.py --models llama3-8b --layers qkv,o,gate_up,down \
      --ms 1,4,16,64,128,256,512,2048,8192 --budgets 0,10 --out "$out/zipper" 2>&1 | tee "$out/zipper.log" | tail -60 ;;
  atom)
    timeout 300 python3 -m pytest -q -n 8 -p no:benchmark -p no:cacheprovider tests/kernels/test_mixed_gemm.py \
      tests/kernels/test_pdl.py -k "mixed or chain_mode_gives" 2>&1 | tee "$out/atom_tests.log" | tail -5
    python3 benchmarks/kernels/mixed_decode.py --ms 4,16,32 --out "$out/mixed_decode" 2>&1 | tee "$out/mixed_decode.log" | tail -16 ;;
  atom_step)
    python3 -m mosaicquant run --model llama-3-8b-shapes --methods fp16,rtn,quarot,atom,resq,spinquant,spinquant:a_symmetric=true \
      --suites throughput:batches=4,32 --device cuda --dtype bfloat16 --report --out "$out/atom_suite" 2>&1 \
      | tee -a "$out/atom_suite.log" | tail -12
    python3 benchmarks/kernels/decode_profile.py --out "$out/profile_atom" --model llama-3-8b-shapes \
      --methods atom --batches 4 --runtimes fused --timeline 2>&1 | tee "$out/profile_atom.log" | tail -30 ;;
  mixed)
    python3 benchmarks/kernels/mixed_decode.py --ms 4,16,32 --out "$out/mixed_decode" 2>&1 | tee "$out/mixed_decode.log" | tail -20 ;;
  nan)
    python3 benchmarks/kernels/nan_guard.py 2>&1 | tee "$out/nan_guard.log" | tail -40 ;;
  suite)
    # torchao's steps do not capture, so they run without graphs beside an eager BF16 row
    python3 -m mosaicquant run --model llama-3-8b-shapes \
      --methods fp16,rtn,quarot,spinquant,spinquant:a_symmetric=true,resq,atom,mosaicquant,mosaicquant:budget=0 \
      --suites throughput \
      --device cuda --dtype bfloat16 --report --out "$out/suite" 2>&1 | tee -a "$out/suite.log" | tail -40
    python3 -m mosaicquant run --model llama-3-8b-shapes \
      --methods fp16,torchao:recipe=int8_dyn,torchao:recipe=int4_wo \
      --suites throughput:cuda_graphs=false \
      --device cuda --dtype bfloat16 --report --out "$out/torchao" 2>&1 | tee -a "$out/torchao.log" | tail -20 ;;
  torchao)
    python3 -m mosaicquant run --model llama-3-8b-shapes \
      --methods fp16,torchao:recipe=int8_dyn:compile=true,torchao:recipe=int4_wo:compile=true \
      --suites throughput:cuda_graphs=false:batches=4,32 \
      --device cuda --dtype bfloat16 --report --out "$out/torchao_compiled" 2>&1 \
      | tee -a "$out/torchao_compiled.log" | tail -20 ;;
  profile)
    python3 benchmarks/kernels/decode_profile.py --out "$out/profile_decode" --model llama-3-8b-shapes \
      --methods rtn,mosaicquant:budget=0,mosaicquant,atom --batches 4,32 --runtimes fused --timeline 2>&1 \
      | tee "$out/profile_decode.log" | tail -60
    python3 benchmarks/kernels/decode_profile.py --out "$out/profile_prefill" --model llama-3-8b-shapes \
      --methods fp16,mosaicquant:budget=0,mosaicquant --runtimes fused --prefill 2048 2>&1 \
      | tee "$out/profile_prefill.log" | tail -30 ;;
  *) echo "unknown step $step (tests, check, kernels, atom, atom_step, mixed, nan, suite, torchao, profile)"; exit 2 ;;
esac
