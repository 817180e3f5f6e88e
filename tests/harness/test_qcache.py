"""The quantized-model cache: bit-identical reload for every method that quantizes, damaged entries, key changes,
and a second run that adds a suite without quantizing again."""

import copy
import dataclasses
import json

import pytest
import torch

from mosaicquant.harness import qcache
from mosaicquant.harness.cli import main
from mosaicquant.harness.context import QuantContext
from mosaicquant.harness.results import load_records
from mosaicquant.harness.spec import RunSpec, parse_plugin_spec
from mosaicquant.registry import METHODS

#: small but non-trivial options per method (SpinQuant trains its rotations for two steps)
METHOD_SPECS = ["rtn", "smoothquant", "quarot", "spinquant:steps=2", "resq", "atom",
                "mosaicquant:block=16:budget=0.25:base=rtn"]


def _float_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _tokens(shape, vocab, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method_spec", METHOD_SPECS)
def test_reloaded_model_gives_bit_identical_logits(method_spec, tiny_llama_dir, tmp_path):
    float_model = _float_model(tiny_llama_dir)
    vocab = float_model.config.vocab_size
    calib = _tokens((4, 32), vocab, seed=3)
    method = parse_plugin_spec(method_spec, "method")
    ctx = QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cpu"), log=lambda _: None)
    quantized = METHODS.get(method.name).fn(copy.deepcopy(float_model), method.config, ctx).eval()
    parts = {"method": method.name, "config": method.config.to_dict(), "test": method_spec}
    cache = qcache.QuantCache(tmp_path, parts, log=lambda _: None)
    cache.store(quantized, float_model, 1.5, dict(ctx.info), None)
    assert cache.status["stored"], cache.status["not_cached"]
    entry = qcache.QuantCache(tmp_path, parts, log=lambda _: None).load(copy.deepcopy(float_model),
                                                                        torch.device("cpu"))
    assert entry is not None and entry.quantize_s == 1.5 and entry.method_info == json.loads(json.dumps(ctx.info))
    ids = _tokens((2, 19), vocab, seed=12)
    with torch.no_grad():
        fresh, reloaded = quantized(input_ids=ids).logits, entry.model(input_ids=ids).logits
    assert torch.equal(fresh, reloaded), f"max |diff| = {(fresh - reloaded).abs().max().item():.3g}"
    with torch.no_grad():
        plain = float_model(input_ids=ids).logits
    assert not torch.equal(fresh, plain), "the method changed nothing: the round trip proves nothing"


#: a cache entry of a 4-bit model is at most this fraction of the float checkpoint: the linears are stored packed
#: (two 4-bit values a byte, FP16 scales, residual blocks), not as their dequantized float weights
MAX_ENTRY_FRACTION = 1 / 3


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory):
    """A random 2-layer Llama whose linears hold most of its weights (hidden 256), as in a real model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("small-llama")
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("method_spec", ["rtn", "quarot:w_quant=rtn", "mosaicquant:score=delta:base=rtn"])
def test_an_entry_stores_packed_weights_and_reloads_them_bit_identically(method_spec, small_llama_dir, tmp_path):
    from pathlib import Path

    float_model = _float_model(small_llama_dir)
    checkpoint = sum(f.stat().st_size for f in Path(small_llama_dir).glob("*.safetensors"))
    vocab = float_model.config.vocab_size
    method = parse_plugin_spec(method_spec, "method")
    calib = _tokens((4, 32), vocab, seed=5)
    ctx = QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cpu"), log=lambda _: None)
    quantized = METHODS.get(method.name).fn(copy.deepcopy(float_model), method.config, ctx).eval()
    parts = {"method": method.name, "config": method.config.to_dict()}
    qcache.QuantCache(tmp_path, parts, log=lambda _: None).store(quantized, float_model, 1.0, dict(ctx.info), None)
    entry_bytes = sum(f.stat().st_size for f in (tmp_path / qcache.CACHE_FOLDER).iterdir())
    assert 0 < entry_bytes < MAX_ENTRY_FRACTION * checkpoint, \
        f"the entry is {entry_bytes} bytes, {entry_bytes / checkpoint:.3f} of the {checkpoint}-byte float checkpoint"
    entry = qcache.QuantCache(tmp_path, parts, log=lambda _: None).load(copy.deepcopy(float_model),
                                                                        torch.device("cpu"))
    assert entry is not None
    ids = _tokens((3, 23), vocab, seed=13)
    with torch.no_grad():
        fresh, reloaded = quantized(input_ids=ids).logits, entry.model(input_ids=ids).logits
    assert torch.equal(fresh, reloaded), f"max |diff| = {(fresh - reloaded).abs().max().item():.3g}"
    for (name, a), (_, b) in zip(quantized.named_modules(), entry.model.named_modules()):
        if getattr(a, "packed", None) is not None:
            assert torch.equal(a.weight, b.weight) and torch.equal(a.packed.qweight, b.packed.qweight), name


def test_an_unchanged_model_is_not_stored(tiny_llama_dir, tmp_path):
    float_model = _float_model(tiny_llama_dir)
    cache = qcache.QuantCache(tmp_path, {"m": "fp16"}, log=lambda _: None)
    cache.store(copy.deepcopy(float_model), float_model, 0.1, {}, None)
    assert not cache.status["stored"] and "nothing to store" in cache.status["not_cached"]
    assert not (tmp_path / qcache.CACHE_FOLDER).exists() or not any((tmp_path / qcache.CACHE_FOLDER).iterdir())


def test_a_closure_hook_makes_the_model_not_cacheable(tiny_llama_dir, tmp_path):
    float_model = _float_model(tiny_llama_dir)
    model = copy.deepcopy(float_model)
    scale = 2.0
    model.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: out * scale)
    cache = qcache.QuantCache(tmp_path, {"m": "hooked"}, log=lambda _: None)
    cache.store(model, float_model, 0.1, {}, None)
    assert not cache.status["stored"] and "forward hook" in cache.status["not_cached"]


def _spec(tmp_path, model, **over):
    fields = dict(model=model, methods=[parse_plugin_spec("rtn", "method")],
                  suites=[parse_plugin_spec("memory", "suite")], out=tmp_path, corpus="tiny-text",
                  calib_samples=4, calib_seqlen=32, seeds=[0], dtype="float32", device="cpu")
    fields.update(over)
    return RunSpec(**fields)


def test_the_key_changes_with_every_option_calibration_setting_and_model(tiny_llama_dir, tiny_corpus, tmp_path):
    import shutil

    spec = _spec(tmp_path, tiny_llama_dir)
    base = qcache.cache_key(qcache.key_parts(spec, spec.methods[0], 0))
    assert base == qcache.cache_key(qcache.key_parts(_spec(tmp_path, tiny_llama_dir), spec.methods[0], 0))
    other_model = tmp_path / "other-model"
    shutil.copytree(tiny_llama_dir, other_model)
    config = json.loads((other_model / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (other_model / "config.json").write_text(json.dumps(config))
    variants = {
        "option": (spec, parse_plugin_spec("rtn:wbits=8", "method"), 0),
        "method": (spec, parse_plugin_spec("quarot", "method"), 0),
        "seed": (spec, spec.methods[0], 1),
        "corpus": (_spec(tmp_path, tiny_llama_dir, corpus="enwiki-sample"), spec.methods[0], 0),
        "calib_samples": (_spec(tmp_path, tiny_llama_dir, calib_samples=8), spec.methods[0], 0),
        "calib_seqlen": (_spec(tmp_path, tiny_llama_dir, calib_seqlen=64), spec.methods[0], 0),
        "dtype": (_spec(tmp_path, tiny_llama_dir, dtype="bfloat16"), spec.methods[0], 0),
        "model": (_spec(tmp_path, str(other_model)), spec.methods[0], 0),
    }
    keys = {name: qcache.cache_key(qcache.key_parts(*args)) for name, args in variants.items()}
    assert all(key != base for key in keys.values()), keys
    assert len(set(keys.values())) == len(keys)


def _run(tmp_path, model, corpus, suites, methods="rtn"):
    return main(["run", "--model", model, "--methods", methods, "--suites", suites, "--corpus", corpus,
                 "--calib-samples", "4", "--calib-seqlen", "32", "--max-chunks", "3", "--out", str(tmp_path / "res")])


def _counting(monkeypatch, name):
    """Wrap the registered method ``name``'s entry point and count its calls."""
    entry = METHODS.get(name)
    calls = []

    def counted(model, config, ctx):
        calls.append(config)
        return original(model, config, ctx)

    original = entry.fn
    monkeypatch.setitem(METHODS._entries, name, dataclasses.replace(entry, fn=counted))
    return calls


def _by_suite(out):
    return {(r["method"]["label"], r["suite"]["name"]): r for r in load_records(out)}


def test_a_second_run_adding_a_suite_does_not_quantize_again(tmp_path, tiny_llama_dir, tiny_corpus, monkeypatch):
    calls = {name: _counting(monkeypatch, name) for name in ("rtn", "smoothquant")}
    methods = "rtn,smoothquant"
    assert _run(tmp_path, tiny_llama_dir, tiny_corpus, "memory", methods) == 0
    assert {name: len(c) for name, c in calls.items()} == {"rtn": 1, "smoothquant": 1}
    firsts = _by_suite(tmp_path / "res")
    assert _run(tmp_path, tiny_llama_dir, tiny_corpus, "memory,accuracy:seqlen=32", methods) == 0
    assert {name: len(c) for name, c in calls.items()} == {"rtn": 1, "smoothquant": 1}, "the second run quantized"
    records = _by_suite(tmp_path / "res")
    assert len(records) == 4 and all(r["status"] == "ok" for r in records.values())
    for name in ("rtn", "smoothquant"):
        first, second = firsts[(name, "memory")], records[(name, "accuracy")]
        assert first["quantized_cache"]["stored"] and not first["quantized_cache"]["hit"]
        assert second["quantized_cache"]["hit"] and second["quantized_cache"]["key"] == first["quantized_cache"]["key"]
        assert second["timing"]["quantize_s"] == first["timing"]["quantize_s"]
        assert second["timing"]["cache_load_s"] >= 0
        assert second["method_info"] == first["method_info"] and second["method_info"]["wbits"] == 4
        assert second["calibration"] == first["calibration"]
        assert {k: v for k, v in second["metrics"].items() if k.startswith("bits/")} == \
            {k: v for k, v in first["metrics"].items() if k.startswith("bits/")}
    assert records[("smoothquant", "accuracy")]["calibration"]["n_samples"] == 4
    # the accuracy numbers of the cached models are those of freshly quantized ones
    fresh = tmp_path / "fresh"
    assert main(["run", "--model", tiny_llama_dir, "--methods", methods, "--suites", "accuracy:seqlen=32", "--corpus",
                 tiny_corpus, "--calib-samples", "4", "--calib-seqlen", "32", "--max-chunks", "3",
                 "--out", str(fresh)]) == 0
    assert {name: len(c) for name, c in calls.items()} == {"rtn": 2, "smoothquant": 2}
    for name in ("rtn", "smoothquant"):
        assert _by_suite(fresh)[(name, "accuracy")]["metrics"]["ppl"] == records[(name, "accuracy")]["metrics"]["ppl"]


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_index"])
def test_a_damaged_entry_is_detected_and_quantized_again(damage, tmp_path, tiny_llama_dir, tiny_corpus, monkeypatch):
    calls = _counting(monkeypatch, "rtn")
    assert _run(tmp_path, tiny_llama_dir, tiny_corpus, "memory") == 0
    folder = tmp_path / "res" / qcache.CACHE_FOLDER
    (tensors,) = folder.glob("*.safetensors")
    data = bytearray(tensors.read_bytes())
    if damage == "truncate":
        tensors.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flip":
        data[-5] ^= 0xFF
        tensors.write_bytes(bytes(data))
    else:
        next(folder.glob("*.json")).unlink()
    assert _run(tmp_path, tiny_llama_dir, tiny_corpus, "memory,accuracy:seqlen=32") == 0
    assert len(calls) == 2, "a damaged entry was used instead of quantizing again"
    record = _by_suite(tmp_path / "res")[("rtn", "accuracy")]
    assert record["status"] == "ok" and not record["quantized_cache"]["hit"]
    assert "damaged" in record["quantized_cache"]["warning"] and record["quantized_cache"]["stored"]
    # the entry written again serves the next run
    assert _run(tmp_path, tiny_llama_dir, tiny_corpus, "memory,accuracy:seqlen=32,accuracy:seqlen=16") == 0
    assert len(calls) == 2
