"""Security scan of the package source: no unpickling of files, YAML only through the safe loader, no
shell strings, no eval/exec, every download pinned by sha256, clusters bound to this machine.

The scan walks the syntax tree of every ``mosaicquant/**/*.py``; a finding names file, line and rule.
An exception is listed in ``ALLOWED`` with the reason it is safe, so adding one is a visible decision.
"""

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import mosaicquant

PACKAGE = Path(mosaicquant.__file__).parent

#: (file relative to the package, enclosing function, rule) -> why it is safe
ALLOWED = {
    ("harness/executors.py", "_run_on_worker", "unpickle"):
        "the payload is the task this module's own client pickled (cloudpickle.dumps in DaskExecutor.run) and "
        "sent through a scheduler that listens on 127.0.0.1 (clusters started here) or on a site's secured "
        "cluster; no file or user-supplied bytes are unpickled",
}

_PICKLE_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}
_UNSAFE_YAML = {"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load", "full_load_all"}
_SAFE_LOADERS = {"SafeLoader", "CSafeLoader"}
_SUBPROCESS = {"run", "call", "check_call", "check_output", "Popen", "getoutput", "getstatusoutput"}
_NETWORK = {("urllib", "urlopen"), ("request", "urlopen"), ("urllib", "urlretrieve"), ("request", "urlretrieve"),
            ("requests", "get"), ("requests", "post"), ("httpx", "get")}
_NETWORK_NAMES = {"hf_hub_download", "snapshot_download", "urlopen", "urlretrieve"}


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def scan_source(text: str, filename: str = "<source>") -> list[tuple[int, str, str, str]]:
    """Findings in one file: ``(line, enclosing function, rule, code)``."""
    tree = ast.parse(text, filename)
    findings = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                rule = _rule(child)
                if rule:
                    findings.append((child.lineno, function, rule, ast.unparse(child)[:120]))
            visit(child, inner)

    visit(tree, "<module>")
    return findings


def _rule(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    parts = name.split(".")
    head, last = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if head in _PICKLE_MODULES and last in ("load", "loads", "Unpickler", "open"):
        return "unpickle"
    if name == "torch.load" and not _is_true(_keyword(call, "weights_only")):
        return "torch.load without weights_only=True"
    if head in ("np", "numpy") and last == "load" and _is_true(_keyword(call, "allow_pickle")):
        return "numpy.load with allow_pickle=True"
    if head == "yaml" and last in _UNSAFE_YAML:
        loader = _dotted(_keyword(call, "Loader")) if _keyword(call, "Loader") is not None else ""
        if loader.split(".")[-1] not in _SAFE_LOADERS:
            return "yaml load without the safe loader"
    if head == "subprocess" and last in _SUBPROCESS:
        if _is_true(_keyword(call, "shell")):
            return "subprocess with shell=True"
        if call.args and not isinstance(call.args[0], (ast.List, ast.Tuple)) and last not in ("getoutput",
                                                                                               "getstatusoutput"):
            first = call.args[0]
            if not (isinstance(first, ast.Name) or isinstance(first, ast.Starred)):
                return "subprocess with a command string"
        if last in ("getoutput", "getstatusoutput"):
            return "subprocess through a shell"
    if name in ("os.system", "os.popen") or (head == "os" and last.startswith(("exec", "spawn"))):
        return "shell command through os"
    if isinstance(call.func, ast.Name) and call.func.id in ("eval", "exec", "compile", "__import__"):
        return f"{call.func.id}()"
    if (head, last) in _NETWORK or (isinstance(call.func, ast.Name) and call.func.id in _NETWORK_NAMES) or \
            last in _NETWORK_NAMES:
        return "download outside the hash-verified asset fetcher"
    return None


def _package_findings():
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for line, function, rule, code in scan_source(path.read_text(encoding="utf-8"), str(path)):
            if (relative, function, rule) not in ALLOWED:
                out.append(f"mosaicquant/{relative}:{line} in {function}: {rule}: {code}")
    return out


def test_package_source_has_no_unsafe_call():
    findings = _package_findings()
    assert not findings, "unsafe calls (allow one only in ALLOWED, with the reason):\n" + "\n".join(findings)


def test_every_allowed_exception_still_exists():
    """A stale entry would silently allow the next such call in that function."""
    present = set()
    for relative, function, rule in ALLOWED:
        text = (PACKAGE / relative).read_text(encoding="utf-8")
        if any(f == function and r == rule for _, f, r, _ in scan_source(text)):
            present.add((relative, function, rule))
    assert present == set(ALLOWED)


@pytest.mark.parametrize("code, rule", [
    ("import pickle\npickle.load(open('x', 'rb'))", "unpickle"),
    ("import cloudpickle\ncloudpickle.loads(b'')", "unpickle"),
    ("import torch\ntorch.load('x.pt')", "torch.load without weights_only=True"),
    ("import torch\ntorch.load('x.pt', weights_only=False)", "torch.load without weights_only=True"),
    ("import numpy as np\nnp.load('x.npy', allow_pickle=True)", "numpy.load with allow_pickle=True"),
    ("import yaml\nyaml.load(text)", "yaml load without the safe loader"),
    ("import yaml\nyaml.load(text, Loader=yaml.FullLoader)", "yaml load without the safe loader"),
    ("import yaml\nyaml.unsafe_load(text)", "yaml load without the safe loader"),
    ("import subprocess\nsubprocess.run(['ls', d], shell=True)", "subprocess with shell=True"),
    ("import subprocess\nsubprocess.run(f'ls {d}')", "subprocess with a command string"),
    ("import subprocess\nsubprocess.getoutput('ls ' + d)", "subprocess through a shell"),
    ("import os\nos.system('rm -rf ' + d)", "shell command through os"),
    ("eval(user_text)", "eval()"),
    ("exec(user_text)", "exec()"),
    ("import urllib.request\nurllib.request.urlopen(url)", "download outside the hash-verified asset fetcher"),
    ("from huggingface_hub import hf_hub_download\nhf_hub_download('a/b', 'f')",
     "download outside the hash-verified asset fetcher"),
])
def test_scan_finds_each_unsafe_pattern(code, rule):
    assert [f[2] for f in scan_source(code)] == [rule]


@pytest.mark.parametrize("code", [
    "import torch\ntorch.load('x.pt', weights_only=True)",
    "import yaml\nyaml.safe_load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "import subprocess\nsubprocess.run(['git', 'rev-parse', rev], check=False)",
    "import subprocess\nsubprocess.run(command, timeout=5)",
    "model.eval()",
    "import numpy as np\nnp.load('x.npy')",
])
def test_scan_passes_the_safe_forms(code):
    assert scan_source(code) == []


def test_every_pinned_asset_has_a_sha256():
    """Downloads go through assets.fetch_pypi_member, which always checks the file's sha256 (its tests check
    the refusal); here: every asset the package declares pins one."""
    from mosaicquant.harness.assets import PypiAsset

    found = {}
    for info in pkgutil.walk_packages(mosaicquant.__path__, "mosaicquant."):
        if not info.name.startswith("mosaicquant.harness"):
            continue
        module = importlib.import_module(info.name)
        found.update({f"{info.name}.{k}": v for k, v in vars(module).items() if isinstance(v, PypiAsset)})
    assert "mosaicquant.harness.assets.SMOLLM2_135M_GGUF" in found
    for name, asset in found.items():
        digest = asset.member_sha256
        assert len(digest) == 64 and all(c in "0123456789abcdef" for c in digest.lower()), name


def test_clusters_started_here_listen_on_this_machine_only(monkeypatch):
    """The Dask clusters the executor starts bind 127.0.0.1: nothing on the network reaches their scheduler."""
    from mosaicquant.harness import executors
    from mosaicquant.harness.spec import load_run_spec

    seen = {}

    class Fake:
        def __init__(self, *args, **kwargs):
            seen[type(self).__name__] = kwargs

    fake = type("distributed", (), {"LocalCluster": type("LocalCluster", (Fake,), {}),
                                    "SpecCluster": type("SpecCluster", (Fake,), {}),
                                    "Nanny": object, "Scheduler": object})
    spec = load_run_spec(None, {"model": "smollm2-135m", "methods": "fp16", "suites": "accuracy"})
    executor = executors.DaskExecutor(spec, executors.ExecutorSettings(kind="dask", workers=1))
    executor._cpu_cluster(fake)
    assert seen["LocalCluster"]["host"] == "127.0.0.1" and seen["LocalCluster"]["dashboard_address"] is None
    spec.device = "cuda"
    monkeypatch.setattr(executors, "visible_gpus", lambda: ["0", "1"])
    gpu = executors.DaskExecutor(spec, executors.ExecutorSettings(kind="dask", gpus=2, gpus_per_cell=2))
    gpu._gpu_cluster(fake)
    options = seen["SpecCluster"]
    assert options["scheduler"]["options"]["host"] == "127.0.0.1"
    assert all(worker["options"]["host"] == "127.0.0.1" for worker in options["workers"].values())
