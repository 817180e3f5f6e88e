"""On the real SmolLM2: the rotation (with its online Hadamards) leaves the float model's outputs unchanged."""

import pytest
import torch

from mosaicquant.harness.models import load_model
from mosaicquant.methods.rotation import rotate_model

# fp32 logits after a 30-layer rotation, relative to the logit range (measured ~2e-6)
ROTATED_LOGITS_RTOL = 1e-4


@pytest.mark.slow
def test_rotation_preserves_smollm2_outputs():
    lm = load_model("smollm2-135m")
    ids = lm.tokenizer("Alabama is a state in the southeastern region of the United States. It borders "
                       "Tennessee to the north and Georgia to the east.", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = lm.model(input_ids=ids).logits
        info = rotate_model(lm.model, seed=0, online_down=True, online_o=True)
        out = lm.model(input_ids=ids).logits
    assert info["residual"]["size"] == 576 and len(info["online"]) == 60
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < ROTATED_LOGITS_RTOL, f"rotation changed SmolLM2's logits: relative error {err:.2e}"
    # the check can fail: dropping one online transform breaks the equivalence
    down = lm.model.model.layers[3].mlp.down_proj
    for h in list(down._forward_pre_hooks):
        del down._forward_pre_hooks[h]
    with torch.no_grad():
        broken = lm.model(input_ids=ids).logits
    assert ((broken - ref).abs().max() / ref.abs().max()).item() > 100 * ROTATED_LOGITS_RTOL
