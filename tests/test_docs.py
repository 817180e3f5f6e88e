"""The documentation against the code: README.md's size, every relative link (and anchor) of README.md,
docs/*.md and benchmarks/results/README.md, the record sets and scripts they cite, and the commands they quote.

Commands are read from the pages' ``bash`` blocks. The cheap ones run as written, in this process
(``python -m mosaicquant`` is :func:`mosaicquant.harness.cli.main`): every ``--help``, ``ls``, ``report`` of a
committed record set (its outputs redirected to a temporary folder, the set only read), ``compare`` of two
committed sets and a plain ``fingerprint``. The expensive ones (a sweep, a GPU run) are parsed as the CLI parses
them, up to the validated run spec, without running. ``config.md`` must list every option of every method and
suite with the config's default, and ``cli.md`` every option of ``run``.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mosaicquant.harness.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOC_PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "results" / "README.md"]

#: the README is the front door, not a notebook
README_MAX_BYTES = 15_000

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
_CLI_START = re.compile(r"(?:^|&&\s*)((?:python3? -m |\.venv/bin/)?mosaicquant\s.*)$")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _links() -> list[tuple[Path, str]]:
    out = []
    for page in DOC_PAGES:
        text = _FENCE.sub("", page.read_text(encoding="utf-8"))
        out += [(page, m.group(1)) for m in _LINK.finditer(text)]
    return out


def _commands() -> list[tuple[Path, str]]:
    """Every shell command line of the pages' ``bash`` blocks (continuation lines joined)."""
    out = []
    for page in DOC_PAGES:
        for block in _FENCE.findall(page.read_text(encoding="utf-8")):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip():
                    out.append((page, " ".join(line.split())))
    return out


def _cli_argv(line: str) -> list[str] | None:
    """The arguments after ``mosaicquant`` of a command line that runs the CLI, else None."""
    m = _CLI_START.search(line)
    if m is None:
        return None
    words = shlex.split(re.sub(r"\$\([^)]*\)", "HEAD", m.group(1)))  # $(git rev-list ...): a revision
    start = words.index("mosaicquant") if "mosaicquant" in words else 0
    return words[start + 1:]


CLI_COMMANDS = [(page, line, argv) for page, line in _commands() if (argv := _cli_argv(line)) is not None]


def _ids(items) -> list[str]:
    return [f"{_rel(page)}: {line[:70]}" for page, line, *_ in items]


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; at most {README_MAX_BYTES:,}"


def test_pages_quote_commands():
    """The extraction finds the pages' commands (guards the checks below against an empty list)."""
    names = {argv[0] for _, _, argv in CLI_COMMANDS if argv}
    assert {"run", "ls", "report", "compare", "fingerprint"} <= names, sorted(names)
    assert sum(1 for _, _, argv in CLI_COMMANDS if "--help" in argv) >= 5


@pytest.mark.parametrize(("page", "target"), _links(), ids=[f"{_rel(p)} -> {t}" for p, t in _links()])
def test_relative_link_resolves(page, target):
    if re.match(r"^[a-z]+:", target):  # https:, mailto:
        return
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{_rel(page)} links to {target!r}: {dest} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{_rel(page)} links to {target!r}: no heading with anchor #{anchor}"


def test_cited_record_sets_exist():
    for page in DOC_PAGES:
        for name in re.findall(r"benchmarks/results/([\w.\-]+)", page.read_text(encoding="utf-8")):
            assert (REPO / "benchmarks" / "results" / name).exists(), f"{_rel(page)} cites missing {name!r}"


SCRIPT_COMMANDS = [(p, ln) for p, ln in _commands() if re.search(r"benchmarks/\S+\.(py|sh)", ln)]


@pytest.mark.parametrize(("page", "line"), SCRIPT_COMMANDS, ids=lambda v: v if isinstance(v, str) else _rel(v))
def test_quoted_benchmark_scripts_exist(page, line):
    for script in re.findall(r"(benchmarks/\S+\.(?:py|sh))", line):
        assert (REPO / script).is_file(), f"{_rel(page)} quotes {script}, which does not exist"


_IMPORT = re.compile(r"\bfrom (mosaicquant[\w.]*) import ([\w, ]+)")


@pytest.mark.parametrize(("page", "module", "names"),
                         [(p, m.group(1), m.group(2)) for p in DOC_PAGES
                          for block in re.findall(r"^```(?:bash|python)\n(.*?)^```", p.read_text(encoding="utf-8"),
                                                  re.M | re.S)
                          for m in _IMPORT.finditer(block)],
                         ids=lambda v: v if isinstance(v, str) else _rel(v))
def test_quoted_imports_resolve(page, module, names):
    imported = importlib.import_module(module)
    for name in (n.strip() for n in names.split(",")):
        assert hasattr(imported, name), f"{_rel(page)}: {module} has no {name!r}"


def _run_cli(argv, capsys) -> tuple[int, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


@pytest.fixture(scope="module")
def listing() -> str:
    """``mosaicquant ls``'s output (methods and suites with their options, models, backends)."""
    out = subprocess.run([sys.executable, "-m", "mosaicquant", "ls"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _committed(path: str) -> bool:
    return (REPO / path).is_dir() and path.startswith("benchmarks/results/")


def _run_spec(argv):
    from mosaicquant.harness.spec import load_run_spec

    args = build_parser().parse_args(argv)
    overrides = {k: getattr(args, k) for k in ("model", "methods", "suites", "seeds", "corpus", "calib_samples",
                                                "calib_seqlen", "max_chunks", "out", "device", "dtype")}
    spec = load_run_spec(args.spec, overrides)
    spec.validate()
    return args, spec


@pytest.mark.parametrize(("page", "line", "argv"), CLI_COMMANDS, ids=_ids(CLI_COMMANDS))
def test_quoted_cli_command(page, line, argv, capsys, tmp_path, listing):
    where = f"{_rel(page)}: {line}"
    command = argv[0] if argv else ""
    if "--help" in argv or not argv:
        rc, out = _run_cli(argv, capsys)
        assert rc == 0 and "usage: mosaicquant" in out, where
    elif command == "ls":
        rc, out = _run_cli(argv, capsys)
        assert rc == 0, where
        what = argv[1] if len(argv) > 1 else "all"
        for section in (["methods", "suites", "backends", "models", "corpora"] if what == "all" else [what]):
            assert re.search(rf"^{section}\b.*:$", out, re.M), f"{where}: no {section!r} section in\n{out[:500]}"
    elif command == "report" and _committed(argv[1]):
        records = sorted((REPO / argv[1]).glob("*.json"))
        before = {p: p.stat().st_mtime_ns for p in (REPO / argv[1]).iterdir()}
        report = tmp_path / "report.md"
        rc, out = _run_cli(["report", argv[1], "-o", str(report)], capsys)
        assert rc == 0, f"{where}\n{out[-2000:]}"
        text = report.read_text(encoding="utf-8")
        methods = {p.name.split("__")[1] for p in records}
        assert records and all(m.split("_")[0] in text for m in methods), f"{where}: {sorted(methods)} not all shown"
        rows = (tmp_path / "summary.csv").read_text(encoding="utf-8").splitlines()
        assert len(rows) >= 2, f"{where}: summary.csv has no rows"
        assert {p: p.stat().st_mtime_ns for p in (REPO / argv[1]).iterdir()} == before, f"{where}: wrote into DIR"
    elif command == "compare" and _committed(argv[1]) and _committed(argv[2]):
        rc, out = _run_cli(argv, capsys)
        assert "ppl" in out and "fp16" in out, f"{where}: no compared metric printed\n{out[-2000:]}"
        # a set against itself cannot regress; the pages say what the other pairs give
        expected = 0 if argv[1] == argv[2] else 1
        assert rc == expected, f"{where}: exit code {rc}, the pages say {expected}\n{out[-2000:]}"
    elif command == "fingerprint" and len(argv) == 1:
        rc, out = _run_cli(argv, capsys)
        assert rc == 0 and re.fullmatch(r"[0-9a-f]{16,64}", out.strip()), f"{where}: {out!r}"
    elif command == "run":
        args, spec = _run_spec(argv)
        assert spec.methods and spec.suites, where
        assert re.search(rf"^\s+{re.escape(spec.model)}\s", listing, re.M), f"{where}: model {spec.model!r} not listed"
        if args.backend:
            name = args.backend.split(":", 1)[0]
            assert re.search(rf"^\s+{re.escape(name)}\s", listing, re.M), f"{where}: backend {name!r} not listed"
    else:  # compare of folders a reader makes, fingerprint of revisions: the parser accepts them
        args = build_parser().parse_args(argv)
        assert args.command == command, where


def test_compare_pair_in_cli_md_regresses_for_the_stated_reason(capsys):
    """cli.md says smollm2_main against smollm2_speed fails on cells missing in the second set."""
    rc, out = _run_cli(["compare", "benchmarks/results/smollm2_main", "benchmarks/results/smollm2_speed",
                        "--fail-on", "ppl:5%"], capsys)
    assert rc == 1
    assert re.search(r"rtn:wbits=8:abits=8\b.*missing in new", out), out[-2000:]


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^### `([^`]+)`\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_config_md_lists_every_option(listing):
    sections = _sections((REPO / "docs" / "config.md").read_text(encoding="utf-8"))
    entries = re.findall(r"^  (\S+)\s+.*\[options: ([^\]]*)\]$", listing, re.M)
    assert len(entries) >= 15, listing[:500]
    for name, options in entries:
        assert name in sections, f"docs/config.md has no section for {name!r}"
        for option in [o.strip() for o in options.split(",") if o.strip() not in ("", "-")]:
            assert f"| `{option}` |" in sections[name], f"docs/config.md: {name!r} lacks option {option!r}"


def test_cli_md_names_every_run_option(capsys):
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    rc, usage = _run_cli(["run", "--help"], capsys)
    options = sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", usage)))
    assert rc == 0 and len(options) >= 15, usage
    for option in options:
        if option != "--help":
            assert f"`{option}" in text, f"docs/cli.md does not name run's {option}"


def _default_text(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def test_config_md_defaults_are_the_configs_defaults(listing):
    from mosaicquant.harness.spec import parse_plugin_spec

    sections = _sections((REPO / "docs" / "config.md").read_text(encoding="utf-8"))
    kinds = {}
    kind = None
    for line in listing.splitlines():
        if line in ("methods:", "suites:"):
            kind = line[:-2]
        elif not line.startswith("  "):
            kind = None
        elif kind:
            kinds[line.split()[0]] = kind
    assert "mosaicquant" in kinds and "accuracy" in kinds, kinds
    for name, kind in kinds.items():
        config = parse_plugin_spec(name, kind).config
        for field in dataclasses.fields(config):
            row = re.search(rf"^\| `{field.name}` \| `([^`]*)` \|", sections[name], re.M)
            assert row, f"docs/config.md: {name!r} has no row for {field.name!r}"
            assert row.group(1) == _default_text(getattr(config, field.name)), (
                f"docs/config.md: {name}.{field.name} default {row.group(1)!r}, "
                f"the config says {_default_text(getattr(config, field.name))!r}")


def test_methods_page_lists_each_methods_supports():
    from mosaicquant.registry import BUILTIN_MODULES, METHODS

    text = (REPO / "docs" / "methods.md").read_text()
    section = text.split("## What each method can run", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    expected = {}
    for entry in (e for e in METHODS.registered() if e.fn.__module__ in BUILTIN_MODULES["method"]):
        supports = entry.supports_for()
        archs = "any" if supports.architectures is None else ", ".join(f"`{a}`" for a in supports.architectures)
        expected[entry.name] = [", ".join(supports.devices), ", ".join(supports.dtypes), archs]
    assert rows == expected, "docs/methods.md's table of what each method can run differs from the registry"
