"""The ``mosaicquant`` command line (argparse lives here and nowhere else).

Commands:
    run      sweep methods × suites × seeds on one model and write one record per cell
    ls       list methods, suites, models, corpora
    report   render tables and figures from a results directory
    compare  compare two results directories; exit 1 on a regression (CI)
    export   write a results directory to an MLflow file store; check it against the record schema
    fingerprint  the package source's fingerprint (records' ``git.source_sha256``), of this tree or of commits

Bad input (unknown name, out-of-range option, missing asset, unwritable directory) prints
one line ``mosaicquant: error: ...`` and exits with code 2, before any long work.
"""

from __future__ import annotations

import argparse
import sys

from mosaicquant.errors import MosaicQuantError

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    """argparse with the command line's one-line errors: ``mosaicquant: error: ...`` and exit 2, the usage left to
    ``--help`` (argparse prints the whole usage first, which pushes the error out of a CI log's last line)."""

    def error(self, message: str):
        self.exit(2, f"mosaicquant: error: {self.prog}: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mosaicquant", description="W4A4 LLM quantization benchmarking harness")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a sweep and write result records")
    r.add_argument("--spec", help="YAML run spec (command-line options override it)")
    r.add_argument("--model", help="built-in name (see 'mosaicquant ls models'), local folder, .gguf file or hub id")
    r.add_argument("--methods", help="comma-separated name[:key=value...] list, e.g. fp16,rtn:wbits=8:abits=8,rtn")
    r.add_argument("--suites", help="comma-separated suite list, e.g. accuracy")
    r.add_argument("--seeds", help="comma-separated seeds (default 0)")
    r.add_argument("--corpus", help="text corpus for calibration and perplexity (default enwiki-sample)")
    r.add_argument("--calib-samples", type=int, dest="calib_samples", help="calibration sequences (default 128)")
    r.add_argument("--calib-seqlen", type=int, dest="calib_seqlen", help="calibration sequence length (default 2048)")
    r.add_argument("--max-chunks", type=int, dest="max_chunks", help="perplexity: evaluate at most N chunks")
    r.add_argument("--out", help="results directory (default results)")
    r.add_argument("--device", help="cpu (default), cuda or cuda:N")
    r.add_argument("--dtype", help="float32 (default on CPU), bfloat16 or float16")
    r.add_argument("--backend", help="what runs the cells: torch (default, in this process) or a registered backend "
                                     "name[:key=value...], e.g. tensorrt-llm (see 'mosaicquant ls backends'; "
                                     "'backend:' in the run spec)")
    r.add_argument("--quick", action="store_true",
                   help="preset: a real, small comparison (smollm2-135m; fp16, rtn and quarot without the weight "
                        "clipping search, mosaicquant; perplexity on 4 chunks of 128 tokens; 4 x 128 calibration "
                        "tokens; out results/quick; --report); options given beside it override it")
    r.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bars with an ETA on stderr (calibration, layers, perplexity batches): auto "
                        "(default: when stderr is a terminal), on or off; never written into records")
    r.add_argument("--report", action="store_true", help="render the report when the sweep ends")
    r.add_argument("--executor", default="local",
                   help="where cells run: local (default, this process) or dask (Dask distributed workers)")
    r.add_argument("--workers", type=int, help="dask, --device cpu: worker processes started here (default: cores, at most 4)")
    r.add_argument("--gpus", type=int, help="dask, --device cuda: GPUs of this machine, one worker each (default: all)")
    r.add_argument("--gpus-per-cell", type=int, dest="gpus_per_cell", default=1,
                   help="GPUs each cell holds; above 1 the model is spread over them with device_map=auto")
    r.add_argument("--scheduler", help="dask: address of a running scheduler (tcp://host:8786) instead of starting workers")

    ls = sub.add_parser("ls", help="list what is available")
    ls.add_argument("what", nargs="?", default="all", choices=["all", "methods", "suites", "models", "corpora", "backends"])

    rep = sub.add_parser("report", help="render tables and figures from a results directory")
    rep.add_argument("dir", help="results directory")
    rep.add_argument("-o", "--output", help="Markdown file to write (default DIR/report.md); the figures, summary.csv, "
                                            "summary.tex and records_long.csv go next to it (DIR is only read)")

    cmp = sub.add_parser("compare", help="compare two results directories; exit 1 on a regression",
                         description="Match cells by (model, method, suite), average seeds, and print every "
                                     "compared metric (speed also as vs_fp16/* ratios to the set's own fp16 row). "
                                     "Exit 0: no regression, 1: a regression, 2: bad input, 3: refused (--strict, "
                                     "the protocols differ).")
    cmp.add_argument("base", help="reference results directory")
    cmp.add_argument("new", help="results directory to check")
    cmp.add_argument("--fail-on", dest="fail_on",
                     help="METRIC:PCT[,METRIC:PCT...]: fail when a metric gets worse (by its own direction) by more "
                          "than PCT percent and more than the recorded spread; METRIC is a name, a glob "
                          "(decode_tok_s/*) or a name family (decode_tok_s)")
    cmp.add_argument("--json", dest="json_out", help="also write the comparison as JSON to this file")
    cmp.add_argument("--strict", action="store_true",
                     help="refuse (exit 3) when base and new differ in protocol: test corpus, suite options (seqlen, "
                          "chunks, ...), calibration settings, dtype, device, driver or CUDA (default: a warning)")
    cmp.add_argument("--format", dest="out_format", choices=("text", "github"), default="text",
                     help="github: also print GitHub Actions annotations (::error file=...::) for regressions and "
                          "protocol differences")
    cmp.add_argument("--junit", help="also write the comparison as JUnit XML to this file (one case per watched metric)")

    ex = sub.add_parser("export", help="export a results directory: an MLflow file store, the schema check",
                        description="Write every cell of DIR as a finished MLflow run into a local MLflow file store "
                                    "(the mlruns folder 'mlflow ui --backend-store-uri PATH' reads; MLflow need not "
                                    "be installed), and/or check DIR's records against the published JSON Schema.")
    ex.add_argument("dir", help="results directory")
    ex.add_argument("--mlflow", help="MLflow file store to write: a folder or a file: URI (created when missing)")
    ex.add_argument("--experiment", default="mosaicquant", help="MLflow experiment name (default: mosaicquant)")
    ex.add_argument("--check-schema", dest="check_schema", action="store_true",
                    help="validate every record against mosaicquant/reports/record.schema.json; exit 1 if one fails")

    fp = sub.add_parser("fingerprint", help="the package source's fingerprint (records' git.source_sha256)",
                        description="Print the fingerprint of the mosaicquant/*.py sources this command runs from, "
                                    "or, given git revisions, of each revision's (one 'REV FINGERPRINT' line each): "
                                    "find the commit a record ran, e.g. with $(git rev-list -n 50 HEAD).")
    fp.add_argument("revs", nargs="*", help="git revisions of this checkout (default: the files on disk)")
    return p


def _cmd_run(args) -> int:
    from mosaicquant import progress
    from mosaicquant.harness.backends import parse_backend_spec
    from mosaicquant.harness.executors import ExecutorSettings, make_executor
    from mosaicquant.harness.runner import validate_run
    from mosaicquant.harness.spec import load_run_spec
    from mosaicquant.harness.sweep import run_sweep

    executor = ExecutorSettings(kind=args.executor, workers=args.workers, gpus=args.gpus,
                                gpus_per_cell=args.gpus_per_cell, scheduler=args.scheduler)
    overrides = {k: getattr(args, k) for k in ("model", "methods", "suites", "seeds", "corpus", "calib_samples",
                                                "calib_seqlen", "max_chunks", "out", "device", "dtype", "backend")}
    spec = load_run_spec(args.spec, overrides, preset="quick" if args.quick else None)
    if parse_backend_spec(spec.backend) is None:  # a backend validates the sweep itself
        make_executor(executor, spec)
        validate_run(spec)
    with progress.use(args.progress):
        result = run_sweep(spec, executor=executor, backend=spec.backend)
    unavailable = f", {len(result.unavailable)} not available here" if result.unavailable else ""
    print(f"[mosaicquant] done: {len(result.written)} written, {len(result.skipped)} already finished, "
          f"{len(result.failed)} failed{unavailable}; records in {spec.out}")
    if args.report or args.quick:
        from mosaicquant.reports.tables import write_tables

        path = write_tables(spec.out)
        print(f"[mosaicquant] report: {path}")
        print(path.read_text())
    return 1 if result.failed else 0


def _cmd_ls(args) -> int:
    from mosaicquant.harness import data, models, shapes
    from mosaicquant.registry import BACKENDS, METHODS, SUITES

    what = args.what
    if what in ("all", "methods"):
        print("methods:")
        for e in METHODS.entries():
            print(f"  {e.name:<16} {e.description}  [options: {', '.join(e.config.field_names()) or '-'}]")
    if what in ("all", "suites"):
        print("suites:")
        for e in SUITES.entries():
            print(f"  {e.name:<16} {e.description}  [options: {', '.join(e.config.field_names()) or '-'}]")
    if what in ("all", "backends"):
        print("backends:")
        for e in BACKENDS.entries():
            print(f"  {e.name:<16} {e.description}")
        if not BACKENDS.names():
            print("  (none registered)")
    if what in ("all", "models"):
        print("models (built-in; also a local folder, a .gguf file or a hub id):")
        for name, info in models.BUILTIN_MODELS.items():
            print(f"  {name:<16} {getattr(info, 'description', info)}")
        print("shape models (random weights at a real model's shapes; the throughput, latency and memory suites):")
        for name, shape in shapes.SHAPE_MODELS.items():
            print(f"  {name:<20} {shape.description}")
    if what in ("all", "corpora"):
        print("corpora:")
        for name, info in data.CORPORA.items():
            print(f"  {name:<16} {getattr(info, 'description', info)}")
    return 0


def _cmd_report(args) -> int:
    from mosaicquant.reports.tables import write_tables

    path = write_tables(args.dir, args.output)
    print(path.read_text())
    print(f"[mosaicquant] report written to {path}")
    return 0


def _cmd_compare(args) -> int:
    from mosaicquant.reports.compare import compare_dirs, write_json, write_junit

    result = compare_dirs(args.base, args.new, args.fail_on, strict=args.strict)
    print(result.render())
    if result.protocol:
        print(result.protocol_message(), file=sys.stderr)
    if args.out_format == "github":
        for line in result.github_annotations():
            print(line)
    if args.json_out:
        write_json(result, args.json_out)
        print(f"[mosaicquant] comparison written to {args.json_out}")
    if args.junit:
        write_junit(result, args.junit)
        print(f"[mosaicquant] JUnit XML written to {args.junit}")
    return result.exit_code


def _cmd_export(args) -> int:
    from mosaicquant.errors import UserInputError

    if not args.mlflow and not args.check_schema:
        raise UserInputError("export: nothing to do: give --mlflow PATH (an MLflow file store) and/or --check-schema")
    code = 0
    if args.check_schema:
        from mosaicquant.reports.schema import SCHEMA_PATH, validate_dir

        bad = validate_dir(args.dir)
        for name, errors in bad.items():
            for error in errors:
                print(f"{name}: {error}")
        print(f"[mosaicquant] {len(bad)} record file(s) in {args.dir} break the schema {SCHEMA_PATH.name}")
        code = 1 if bad else 0
    if args.mlflow:
        from mosaicquant.reports.export import export_mlflow

        runs = export_mlflow(args.dir, args.mlflow, args.experiment)
        print(f"[mosaicquant] {len(runs)} MLflow run(s) written to {args.mlflow} (experiment {args.experiment!r})")
    return code


def _cmd_fingerprint(args) -> int:
    from mosaicquant.harness.results import source_fingerprint

    if not args.revs:
        print(source_fingerprint())
    for rev in args.revs:
        print(f"{rev} {source_fingerprint(rev)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mosaicquant`` console script."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, one line already printed)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "ls":
            return _cmd_ls(args)
        if args.command == "report":
            return _cmd_report(args)
        if args.command == "compare":
            return _cmd_compare(args)
        if args.command == "export":
            return _cmd_export(args)
        if args.command == "fingerprint":
            return _cmd_fingerprint(args)
    except MosaicQuantError as exc:
        print(f"mosaicquant: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mosaicquant: interrupted; finished records are kept and a rerun resumes", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
