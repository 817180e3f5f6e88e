"""Tests of model specs: resolution errors, local folders, the hub path offline, and SmolLM2."""

from __future__ import annotations

import pytest
import torch

from mosaicquant.errors import AssetError, UserInputError
from mosaicquant.harness import assets, models

# A folder model reloaded in bf16 must match the fp32 original to bf16 precision.
BF16_LOGITS_ATOL = 0.05

SMOLLM2_SHAPES = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}


def test_builtin_name_resolves_without_loading():
    source = models.resolve_model("smollm2-135m")
    assert (source.kind, source.name) == ("builtin", "smollm2-135m")
    assert "4-bit grid" in source.caveat
    assert set(models.BUILTIN_MODELS) == {"smollm2-135m"}


def test_unknown_builtin_name_suggests_the_close_one():
    with pytest.raises(UserInputError, match=r"Unknown model 'smollm2-13m'. Did you mean: smollm2-135m\? Available: ") as exc:
        models.resolve_model("smollm2-13m")
    # every name a run takes: the built-in model and the speed suites' shape models, and the other kinds of spec
    assert all(name in str(exc.value) for name in ("smollm2-135m", "llama-3-8b-shapes", "qwen3-32b-shapes"))
    assert "a .gguf file or a hub id" in str(exc.value)


def test_unknown_name_suggests_a_shape_model():
    with pytest.raises(UserInputError, match=r"Unknown model 'llama-3-8b'. Did you mean: llama-3-8b-shapes"):
        models.resolve_model("llama-3-8b")


@pytest.mark.parametrize("spec", ["./no-such-model", "/nonexistent/dir/model.gguf", "weights.gguf", "a/b/c", "~/nowhere-xyz"])
def test_missing_paths_are_reported_as_paths(spec):
    with pytest.raises(UserInputError, match="does not exist"):
        models.resolve_model(spec)


@pytest.mark.parametrize("spec", ["", "   ", None])
def test_empty_spec_is_rejected(spec):
    with pytest.raises(UserInputError, match="non-empty string"):
        models.resolve_model(spec)


def test_folder_without_config_and_non_gguf_file_are_rejected(tmp_path):
    with pytest.raises(UserInputError, match="has no config.json"):
        models.resolve_model(str(tmp_path))
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"\x01\x02")
    with pytest.raises(UserInputError, match="is not a .gguf file"):
        models.resolve_model(str(weights))


def test_gguf_file_and_hub_id_resolve(tmp_path):
    gguf = tmp_path / "Tiny-Model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    source = models.resolve_model(str(gguf))
    assert (source.kind, source.name, source.location) == ("gguf", "Tiny-Model.Q4_0", str(gguf))
    assert source.caveat is not None
    hub = models.resolve_model("HuggingFaceTB/SmolLM2-135M")
    assert (hub.kind, hub.location, hub.caveat) == ("hub", "HuggingFaceTB/SmolLM2-135M", None)


def test_hub_id_offline_fails_with_a_clear_asset_error(monkeypatch):
    monkeypatch.setenv(assets.OFFLINE_ENV, "1")
    with pytest.raises(AssetError, match=r"hub id.*MOSAICQUANT_OFFLINE=1.*smollm2-135m"):
        models.load_model("someorg/some-model")


@pytest.fixture()
def tiny_llama_folder(tmp_path):
    """A randomly initialised 2-layer Llama with a word-level tokenizer, saved as an HF folder."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(60)}}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    config = LlamaConfig(
        vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model


def test_folder_model_loads_in_eval_mode_with_requested_dtype(tiny_llama_folder):
    folder, original = tiny_llama_folder
    loaded = models.load_model(str(folder), dtype=torch.bfloat16)
    assert loaded.name == "tiny-llama" and loaded.caveat is None and str(folder) in loaded.source
    assert not loaded.model.training
    assert loaded.model.dtype == torch.bfloat16
    ids = torch.tensor([loaded.tokenizer("w3 w17 w59 w0 w44", add_special_tokens=False)["input_ids"]])
    assert ids.tolist() == [[4, 18, 60, 1, 45]]
    with torch.no_grad():
        expected = original(ids).logits
        got = loaded.model(ids).logits.float()
    assert torch.allclose(got, expected, atol=BF16_LOGITS_ATOL), f"max diff {(got - expected).abs().max():.4f}"


@pytest.mark.parametrize(("kwargs", "pattern"), [({"dtype": torch.int8}, "floating torch.dtype"), ({"device": "gpu0"}, "Unknown device 'gpu0'")])
def test_bad_dtype_and_device_are_rejected(tiny_llama_folder, kwargs, pattern):
    folder, _ = tiny_llama_folder
    with pytest.raises(UserInputError, match=pattern):
        models.load_model(str(folder), **kwargs)


def test_non_finite_weights_are_refused_naming_the_tensors(tiny_llama_folder):
    _, model = tiny_llama_folder
    models.check_finite_weights(model, "tiny")  # the clean model passes
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
        model.model.layers[0].self_attn.q_proj.weight[0, :2] = float("inf")
        model.model.layers[0].self_attn.q_proj.weight[1, 0] = float("nan")
    with pytest.raises(AssetError) as info:
        models.check_finite_weights(model, "tiny")
    message = str(info.value)
    assert "Model 'tiny' has non-finite weights in 2 tensor(s)" in message
    assert "model.layers.0.self_attn.q_proj.weight (1 NaN, 2 Inf of 2,304 values)" in message
    assert "model.layers.1.mlp.down_proj.weight (1 NaN, 0 Inf of 3,840 values)" in message
    with pytest.raises(AssetError, match=r"in 2 tensor\(s\): model.layers.0.self_attn.q_proj.weight .*; and 1 more"):
        models.check_finite_weights(model, "tiny", shown=1)


def test_a_saved_model_with_a_nan_weight_fails_at_load(tiny_llama_folder):
    folder, model = tiny_llama_folder
    with torch.no_grad():
        model.lm_head.weight[7, 1] = float("nan")
    model.save_pretrained(folder)
    with pytest.raises(AssetError, match=r"lm_head.weight \(1 NaN, 0 Inf"):
        models.load_model(str(folder))


def test_smollm2_loads_through_the_fetch_path_with_the_documented_shapes():
    loaded = models.load_model("smollm2-135m")
    model = loaded.model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training and model.dtype == torch.float32
    assert {key: getattr(model.config, key) for key in SMOLLM2_SHAPES} == SMOLLM2_SHAPES
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].mlp.gate_proj.weight.shape == (1536, 576)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (192, 576)
    assert loaded.caveat == models.SMOLLM2_CAVEAT
    assert len(loaded.tokenizer("The capital of France is Paris.", add_special_tokens=False)["input_ids"]) > 3


@pytest.mark.slow
def test_converted_smollm2_folder_equals_the_gguf_load():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = models.load_model("smollm2-135m")
    gguf = models.BUILTIN_MODELS["smollm2-135m"].asset.fetch()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected, got = reference.state_dict(), loaded.model.state_dict()
    assert sorted(expected) == sorted(got)
    mismatched = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert not mismatched, f"tensors differ from the GGUF load: {mismatched[:5]}"
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "Anarchism is a political philosophy.\n\nIt was 1901; ünïcödé, code `x = y**2`."
    assert reference_tokenizer(text, add_special_tokens=False)["input_ids"] == loaded.tokenizer(
        text, add_special_tokens=False
    )["input_ids"]
