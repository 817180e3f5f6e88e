"""MosaicQuant: a benchmarking and evaluation harness for W4A4 LLM quantization.

The package has five parts:

- :mod:`mosaicquant.harness` — registry, configs, models, data, runner, results, CLI.
- :mod:`mosaicquant.methods` — the MosaicQuant method and the shared quantization pieces.
- :mod:`mosaicquant.kernels` — Triton kernels (ZipperEngine and friends).
- :mod:`mosaicquant.baselines` — RTN, SmoothQuant, QuaRot, SpinQuant, ResQ, Atom, ...
- :mod:`mosaicquant.reports` — tables, plots and result-set comparison.
"""

__version__ = "0.1.0"
