export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
D=mosaicquant.kernels.decoder.ATTN_DIRECT_ONE_CHUNK
python3 benchmarks/decode_profile.py --out $OUT/dir --methods fp16,quarot,mosaicquant --batches 32,24 --runtimes fused --no-profile --rounds 3 \
  --variant comb:$D=0 --variant direct:$D=1 > $OUT/dir.log 2>&1
grep "graph" $OUT/dir.log | grep -v "|"
timeout 60 python3 -m pytest -q -x tests/kernels/test_decoder.py -k "attention" 2>&1 | tail -1
timeout 130 python3 -m pytest -q -x tests/kernels/test_w4a4_gemm.py tests/kernels/test_swapped.py tests/kernels/test_mixed_gemm.py tests/kernels/test_gemv.py 2>&1 | tail -1
timeout 90 python3 -m pytest -q -x tests/harness/test_runtime.py -k "decode" 2>&1 | tail -1
