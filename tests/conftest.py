"""Test tiers: unit (default), ``gpu`` (skipped where there is no CUDA GPU), ``slow`` (real model).

Without a GPU, Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``); the
variable must be set before any kernel module is imported, hence here.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found); runs on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 3 + "A stitch in time saves nine.",
    "Quantization maps real numbers onto a small grid of integers; four bits hold sixteen levels.",
    "Rotations spread outliers across channels so that a uniform grid loses less information.",
    "Calibration text is drawn from the training split, and perplexity from the test split.",
    "Hadamard matrices are orthogonal matrices whose entries are plus or minus one.",
    "Block sparse residuals correct the largest errors of a dense four-bit base.",
] * 6


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A randomly initialised 2-layer Llama (hidden 64, tied embeddings) with a small BPE tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TINY_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=fast.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def tiny_corpus(monkeypatch):
    """Register a small in-memory corpus named ``tiny-text`` (train and test documents)."""
    from mosaicquant.harness import data

    docs = {"train": TINY_TEXT[: len(TINY_TEXT) // 2 + 6], "test": TINY_TEXT[len(TINY_TEXT) // 2:]}
    corpus = data.Corpus(name="tiny-text", description="test text", offline=True, loader=lambda split: docs[split])
    monkeypatch.setitem(data.CORPORA, "tiny-text", corpus)
    return "tiny-text"


@pytest.fixture
def tile_table():
    """``tile_table(name=value, ...)``: put tile-table entries in force (kernel settings' ``tiles``) for the test.

    Entries add to those already put; the settings before come back when the test ends.
    """
    import contextlib

    from mosaicquant import settings

    stack = contextlib.ExitStack()

    def put(**entries):
        stack.enter_context(settings.use_tiles(**entries))

    yield put
    stack.close()


@pytest.fixture
def tiny_llama_model():
    """A fresh randomly initialised 2-layer Llama (vocab 97, hidden 96, 6 q / 2 kv heads), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def lm_loss():
    """``fn(model, tokens) -> float``: the mean next-token loss of ``tokens`` under ``model``."""
    def loss(model, tokens) -> float:
        with torch.no_grad():
            return float(model(input_ids=tokens, labels=tokens).loss)
    return loss


@pytest.fixture
def tiny_lm_tokens():
    """``(calibration [4, 48], test [2, 48], quantization context over the calibration)`` for the 97-token
    vocabulary of :func:`tiny_llama_model`, seed 0, CPU."""
    from mosaicquant.harness.context import QuantContext

    gen = torch.Generator().manual_seed(7)
    calib = torch.randint(0, 97, (4, 48), generator=gen)
    test = torch.randint(0, 97, (2, 48), generator=gen)
    return calib, test, QuantContext(calibration=lambda: calib, seed=0, device=torch.device("cpu"), log=lambda s: None)
