"""``summary.tex``: the report's summary table as a LaTeX ``tabular`` that compiles as written.

The file is a fragment for ``\\input{summary.tex}`` inside a document; it needs no package
(plain ``\\hline`` rules, symbols in math mode). Every cell is escaped: the LaTeX specials
``\\ { } $ & # ^ _ % ~`` become their escaped forms, the report's symbols (``↑ ↓ ± × µ Δ …``)
their math-mode commands, and any other non-ASCII character its closest ASCII letters, so that
pdflatex without extra packages reads it. Numbers arrive as the report's fixed-notation text
(:func:`mosaicquant.reports.cells.format_number`), never ``1.82e+04``. Footnotes of the table
(long execution paths) follow it as numbered lines.
"""

from __future__ import annotations

import re
import unicodedata

import pandas as pd

__all__ = ["escape_latex", "render_latex"]

_SPECIALS = {"\\": r"\textbackslash{}", "{": r"\{", "}": r"\}", "$": r"\$", "&": r"\&", "#": r"\#",
             "^": r"\textasciicircum{}", "_": r"\_", "%": r"\%", "~": r"\textasciitilde{}"}
_SYMBOLS = {"↑": r"$\uparrow$", "↓": r"$\downarrow$", "±": r"$\pm$", "×": r"$\times$", "µ": r"$\mu$",
            "μ": r"$\mu$", "Δ": r"$\Delta$", "…": r"\ldots{}", "–": "--", "—": "---", "≤": r"$\leq$",
            "≥": r"$\geq$", "→": r"$\rightarrow$", "²": r"$^2$", "<": r"\textless{}", ">": r"\textgreater{}"}
_FOOTNOTE_MARK = re.compile(r"\[\^(\d+)\]")


def escape_latex(text: str) -> str:
    """``text`` as LaTeX source that prints it (see the module docstring).

    Example:
        >>> escape_latex("rtn:wbits=8 ± 5% ↓")
        'rtn:wbits=8 $\\\\pm$ 5\\\\% $\\\\downarrow$'
    """
    out = []
    for ch in str(text):
        if ch in _SPECIALS:
            out.append(_SPECIALS[ch])
        elif ch in _SYMBOLS:
            out.append(_SYMBOLS[ch])
        elif ord(ch) < 128:
            out.append(ch)
        else:
            out.append(unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode() or "?")
    return "".join(out)


def _cell(text: str) -> str:
    """A table cell: escaped, with the Markdown footnote marks ``[^1]`` as superscripts."""
    parts = _FOOTNOTE_MARK.split(str(text))
    return "".join(escape_latex(p) if i % 2 == 0 else rf"\textsuperscript{{{p}}}" for i, p in enumerate(parts))


def render_latex(df: pd.DataFrame, footnotes: list[str] | None = None) -> str:
    """A ``tabular`` of ``df`` (strings; text columns left, the others right-aligned) and its footnotes.

    Args:
        df: the table as the report shows it (:func:`mosaicquant.reports.tables.paper_table`).
        footnotes: texts marked ``[^i]`` in ``df`` (i from 1).

    Returns:
        The LaTeX source, ending with a newline.
    """
    text_cols = {"model", "method", "execution", "notes"}
    spec = "".join("l" if c in text_cols else "r" for c in df.columns)
    lines = [f"\\begin{{tabular}}{{{spec}}}", r"\hline",
             " & ".join(_cell(c) for c in df.columns) + r" \\", r"\hline"]
    for _, row in df.iterrows():
        lines.append(" & ".join(_cell("" if pd.isna(v) else v) for v in row.tolist()) + r" \\")
    lines += [r"\hline", r"\end{tabular}"]
    if footnotes:
        lines.append(r"\par\smallskip{\footnotesize")
        lines += [rf"\textsuperscript{{{i}}} {escape_latex(t)}\par" for i, t in enumerate(footnotes, 1)]
        lines.append("}")
    return "\n".join(lines) + "\n"
