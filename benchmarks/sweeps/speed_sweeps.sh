#!/usr/bin/env bash
# The GPU sweeps behind benchmarks/results/*_speed* (run from the repository root on a CUDA machine).
#
#   bash benchmarks/sweeps/speed_sweeps.sh OUT_DIR [shapes|latency|input|smollm2|zeroshot|dask|pdl]
#
# shapes   throughput + memory of every method on Llama-3-8B shapes (random weights)
# latency  per-linear-layer latency over M = 1..8192 and step latency on Llama-3-8B shapes
# input    the input side of the W4A4 linears: online Hadamard + act-quant, stacked projections
# smollm2  the real small model: every method quantized for real, then perplexity, throughput + memory
#          (one folder, so its report draws the accuracy-speed Pareto figure; $SMOL_GPUS GPUs through Dask)
# zeroshot the real small model through lm-eval, 200 documents per task ($ZS_METHODS picks methods)
# dask     one speed sweep through Dask on 1 GPU and on 2 GPUs (same 12 cells per model), wall time of each
#          ($DASK_RUNS picks the GPU counts, default "1 2")
# pdl      throughput on Llama-3-8B shapes with programmatic dependent launch off, then as by default (same run)
set -euo pipefail
out=${1:?usage: speed_sweeps.sh OUT_DIR [shapes|latency|input|smollm2|zeroshot|dask|pdl]}
what=${2:-shapes}
mq() { python3 -m mosaicquant "$@"; }
common=(--device cuda --dtype bfloat16 --report)
shape_methods=fp16,rtn,smoothquant,quarot,spinquant,mosaicquant:budget=0,mosaicquant:budget=0.05,mosaicquant,mosaicquant:budget=0.2,atom,resq,torchao:recipe=int8_dyn,torchao:recipe=int4_wo

case "$what" in
shapes)
    mq run --model llama-3-8b-shapes --methods "$shape_methods" --suites throughput,memory "${common[@]}" \
        --out "$out/llama3_8b_speed" ;;
latency)
    mq run --model llama-3-8b-shapes --methods fp16,rtn,quarot,mosaicquant:budget=0,mosaicquant \
        --suites latency "${common[@]}" --out "$out/llama3_8b_latency" ;;
smollm2)
    # the accuracy protocol of benchmarks/results/smollm2_main (16 x 1024 calibration tokens, 8 chunks)
    mq run --model smollm2-135m \
        --methods fp16,rtn,smoothquant,quarot,spinquant,atom,resq,mosaicquant:budget=0,mosaicquant \
        --suites accuracy,throughput,memory "${common[@]}" --calib-samples 16 --calib-seqlen 1024 --max-chunks 8 \
        --executor dask --gpus "${SMOL_GPUS:-1}" --out "$out/smollm2_speed" ;;
input)
    python3 benchmarks/sweeps/input_path.py --out "$out/input_path" ;;
zeroshot)
    zs_methods=${ZS_METHODS:-fp16,rtn,rtn:wbits=8:abits=8,smoothquant,quarot,spinquant,atom,resq,mosaicquant}
    mq run --model smollm2-135m --methods "$zs_methods" --suites zeroshot:limit=200 --device cuda \
        --calib-samples 8 --calib-seqlen 1024 --report --out "$out/smollm2_zeroshot_200docs" ;;
dask)
    # DASK_SEEDS lengthens the sweep (e.g. 0,1,2,3: four times the cells; a seed changes the speed forms' random choices)
    for gpus in ${DASK_RUNS:-1 2}; do
        start=$(date +%s.%N)
        mq run --model qwen3-8b-shapes --seeds "${DASK_SEEDS:-0}" --suites throughput,latency "${common[@]}" \
            --methods fp16,rtn,quarot,mosaicquant:budget=0,mosaicquant,mosaicquant:budget=0.2 \
            --executor dask --gpus "$gpus" --out "$out/qwen3_8b_dask_${gpus}gpu"
        echo "dask --gpus $gpus: $(python3 -c "import time; print(round(time.time() - $start, 1))") s"
    done ;;
pdl)
    for pdl in off default; do
        suite=$([ $pdl = off ] && echo throughput:pdl=false || echo throughput)
        mq run --model llama-3-8b-shapes \
            --methods fp16,rtn,quarot,mosaicquant --suites "$suite" "${common[@]}" --out "$out/llama3_8b_pdl_$pdl"
    done ;;
*) echo "unknown sweep: $what" >&2; exit 2 ;;
esac
