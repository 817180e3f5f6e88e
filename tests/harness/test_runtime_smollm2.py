"""On the real SmolLM2 (9 query / 3 KV heads of 64, tied embeddings): the fused decoder against transformers.

The decoder's wiring on a real model's config, with the kernels' PyTorch references (the Triton
kernels are checked against those references on these head shapes in tests/kernels/test_decoder.py;
in the interpreter the 30-layer model would take minutes).
"""

import math

import pytest
import torch

from mosaicquant.harness.models import load_model
from mosaicquant.harness.runtime import FusedDecoder, fused_reason

# BF16 logits of a 30-layer model through two attention implementations: a few bf16 ulps of the range
LOGIT_TOL = 0.03
KV4_SQNR_DB = 25.0


@pytest.mark.slow
@pytest.mark.parametrize("kv4", [False, True])
def test_fused_decoder_follows_transformers_on_smollm2(kv4):
    # kv4: QuaRot's KV recipe (Q/K Hadamard, 4-bit asymmetric, clip 0.95): the decoder's 4-bit cache against
    # transformers with the method's simulation of it
    from transformers import DynamicCache

    from mosaicquant.methods.kvcache import KVQuantSpec, enable_kv_quant

    lm = load_model("smollm2-135m")
    model = lm.model.to(torch.bfloat16).eval()
    assert fused_reason(model) is None
    if kv4:
        enable_kv_quant(model, KVQuantSpec(bits=4, symmetric=False, clip_ratio=0.95, rotate_qk=True))
    ids = lm.tokenizer("Alabama is a state in the southeastern region of the United States. It borders",
                       return_tensors="pt").input_ids
    n = ids.shape[1]
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        ref = [out.logits[:, -1]]
        steps = []
        for _ in range(3):  # greedy continuation, the eager model's own choices
            steps.append(ref[-1].argmax(-1, keepdim=True))
            ref.append(model(input_ids=steps[-1], past_key_values=cache, use_cache=True).logits[:, -1])
    dec = FusedDecoder(model, kernel="torch")
    assert all((lay.kv_format is not None) == kv4 for lay in dec.layers)
    kv = dec.new_cache(1, n + 4)
    assert (kv.keys[0].dtype == torch.uint8) == kv4
    got = [dec.prefill(ids, kv)]
    for i, token in enumerate(steps):
        got.append(dec.decode(token, torch.tensor([n + i]), kv))
    for i, (g, r) in enumerate(zip(got, ref)):
        err = (g.float() - r.float()).abs().max().item()
        if kv4 and i > 0:
            # a last-bit difference upstream (fp32 against bf16 attention) can move a key's 4-bit integer by a
            # whole step: measured 28.3-28.9 dB here, against 9.6-18.1 dB between the KV4 and KV16 eager models
            g32, r32 = g.float(), r.float()
            sqnr = 10 * torch.log10(r32.pow(2).sum() / (g32 - r32).pow(2).sum()).item()
            assert sqnr >= KV4_SQNR_DB, f"step {i}: logits SQNR {sqnr:.1f} dB"
        else:
            assert err <= LOGIT_TOL * r.float().abs().max().item(), f"step {i}: max |diff| {err:.3g}"
        # the next token chosen is the reference's, or one it scores within a bf16 ulp of its best: its logits
        # can tie (step 1 here: two tokens at 10.8125 in BF16, argmax taking the lower index), and the CPU's
        # bf16 kernels differ between machines in the last bit
        best = r.float().max().item()
        ulp = 2.0 ** (math.floor(math.log2(abs(best))) - 7)
        pick = g.argmax(-1).item()
        assert r.float()[0, pick].item() >= best - ulp, f"step {i}: another next token ({pick}, {r.argmax(-1).item()})"
