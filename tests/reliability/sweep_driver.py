"""Run ``mosaicquant`` in a child process on the tests' tiny corpus (the tests' kill and lock cases).

Usage: ``python sweep_driver.py ARGS...``: the ``mosaicquant`` arguments; the corpus ``tiny-text``
is registered first (the same text as the ``tiny_corpus`` fixture), then the command line runs.
"""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from conftest import TINY_TEXT

    from mosaicquant.harness import data
    from mosaicquant.harness.cli import main

    docs = {"train": TINY_TEXT[: len(TINY_TEXT) // 2 + 6], "test": TINY_TEXT[len(TINY_TEXT) // 2:]}
    data.CORPORA["tiny-text"] = data.Corpus(name="tiny-text", description="test text", offline=True,
                                            loader=lambda split: docs[split])
    sys.exit(main(sys.argv[1:]))
