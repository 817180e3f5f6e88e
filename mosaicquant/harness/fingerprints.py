"""Content fingerprints of local models: what a record keys a folder or ``.gguf`` model by.

A local model's records are keyed by what its files hold, not by where they lie: two folders
both called ``model`` with other weights are two models, and one model reached by another path
(relative, through a symlink, copied elsewhere) is the same one.

- A ``.gguf`` file: the SHA-256 of the file.
- A Hugging Face model folder: the SHA-256 of ``config.json``, of the tokenizer's files
  (:data:`TOKENIZER_FILES`: another tokenizer gives another perplexity) and of every weight
  file in the folder (:data:`WEIGHT_SUFFIXES`), each with its name, in name order. Other files
  (README, licence, a conversion marker) are left out: they change no number.

The fingerprint is the first :data:`FINGERPRINT_HEX` hex digits of that digest. Hashing reads
every byte once; the digest of each file is then cached, in this process and in
``<cache>/fingerprints.json`` (:func:`mosaicquant.harness.assets.cache_dir`), by its resolved
path, size and modification time, so a later run over the same files only stats them. A file
rewritten in place gets a new modification time and is hashed again.

Example:
    >>> model_fingerprint("/data/models/llama-3.2-1b")  # doctest: +SKIP
    '5f0c1d2e3a4b5c6d'
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from mosaicquant.harness import assets

__all__ = ["FINGERPRINT_HEX", "WEIGHT_SUFFIXES", "TOKENIZER_FILES", "model_fingerprint", "file_digest"]

#: hex digits of a model fingerprint
FINGERPRINT_HEX = 16
#: the files of a model folder whose bytes are part of its fingerprint (besides ``config.json``)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: the tokenizer files of a model folder that are part of its fingerprint
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt")
_CACHE_FILE = "fingerprints.json"

_memory: dict[tuple[str, int, int], str] = {}


def _cache_path() -> Path:
    return assets.cache_dir() / _CACHE_FILE


def _read_disk_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: the files are hashed again
    return data if isinstance(data, dict) else {}


def _cache_key(key: tuple[str, int, int]) -> str:
    return f"{key[0]}|{key[1]}|{key[2]}"


def file_digest(path: str | os.PathLike) -> str:
    """Hex SHA-256 of one file, cached by (resolved path, size, modification time in ns).

    Args:
        path: the file.

    Returns:
        The lowercase hex digest.

    Raises:
        OSError: the file cannot be read.
    """
    resolved = Path(path).resolve()
    st = resolved.stat()
    key = (str(resolved), st.st_size, st.st_mtime_ns)
    if key in _memory:
        return _memory[key]
    disk = _read_disk_cache()
    digest = disk.get(_cache_key(key))
    if not isinstance(digest, str):
        digest = assets.sha256_file(resolved)
        disk = _read_disk_cache()  # another process may have added entries meanwhile
        # entries of files that are gone are dropped, so the cache does not grow without bound
        disk = {k: v for k, v in disk.items() if os.path.exists(k.rsplit("|", 2)[0])}
        disk[_cache_key(key)] = digest
        # a cache that cannot be written (read-only home) only costs hashing again next run
        with contextlib.suppress(OSError):
            assets.atomic_write_bytes(_cache_path(), json.dumps(disk, indent=0, sort_keys=True).encode())
    _memory[key] = digest
    return digest


def model_fingerprint(location: str | os.PathLike) -> str:
    """The content fingerprint of a local model (see the module docstring).

    Args:
        location: a Hugging Face model folder (with ``config.json``) or a ``.gguf`` file.

    Returns:
        :data:`FINGERPRINT_HEX` lowercase hex digits.

    Raises:
        OSError: a file of the model cannot be read.
    """
    import hashlib

    path = Path(location)
    if path.is_dir():
        files = sorted(p for p in path.iterdir()
                       if p.is_file() and (p.name in ("config.json", *TOKENIZER_FILES) or p.name.endswith(WEIGHT_SUFFIXES)))
        digest = hashlib.sha256(b"mosaicquant model folder\n")
        for f in files:
            digest.update(f"{f.name}\0{file_digest(f)}\n".encode())
    else:
        digest = hashlib.sha256(b"mosaicquant model file\n")
        digest.update(file_digest(path).encode())
    return digest.hexdigest()[:FINGERPRINT_HEX]
