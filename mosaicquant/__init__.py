"""MosaicQuant: a benchmarking and evaluation harness for W4A4 LLM quantization.

The package has five parts:

- :mod:`mosaicquant.harness` — registry, configs, models, data, runner, results, CLI.
- :mod:`mosaicquant.methods` — the MosaicQuant method and the shared quantization pieces.
- :mod:`mosaicquant.kernels` — Triton kernels (ZipperEngine and friends).
- :mod:`mosaicquant.baselines` — RTN, SmoothQuant, QuaRot, SpinQuant, ResQ, Atom, ...
- :mod:`mosaicquant.reports` — tables, plots and result-set comparison.
"""

__version__ = "0.1.0"

__all__ = ["load_results", "__version__"]


def load_results(path):
    """The cells of a results directory as a pandas DataFrame, one row per (model, method, suite).

    Metrics are flattened into columns (the mean over the cell's ``ok`` seeds, ``<metric>.spread``
    beside each); see :func:`mosaicquant.reports.export.load_results` for every column.

    Example:
        >>> import mosaicquant
        >>> df = mosaicquant.load_results("results/smollm2")  # doctest: +SKIP
    """
    from mosaicquant.reports.export import load_results as _load  # pandas only when asked

    return _load(path)
