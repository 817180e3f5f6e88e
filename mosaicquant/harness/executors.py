"""Where the cells of a sweep run: ``local`` (this process) or ``dask`` (Dask distributed).

Choice of engine: Dask distributed, with dask-cuda for one worker per GPU, rather than Ray.

- It installs from PyPI as pure Python (``dask``, ``distributed``, ``dask-cuda``; their few
  compiled dependencies ship as wheels), so it travels to a machine without a registry as a
  handful of wheels far below 64 MiB; Ray is a ~60 MiB platform wheel per Python version
  with a C++ core (raylet, GCS) whose daemons must match on every node.
- ``LocalCluster`` runs on one laptop with no daemons or ports to configure, which lets the
  CPU test suite drive a real multi-process cluster; dask-cuda's ``LocalCUDACluster``
  starts one worker per GPU with its own ``CUDA_VISIBLE_DEVICES``; the same code connects to
  an existing cluster (``--scheduler tcp://host:8786``; SLURM/PBS through dask-jobqueue,
  Kubernetes through dask-kubernetes), which is how HPC sites already run Dask.
- Worker *resources* (``GPU=1``, ``CPU=1``) are exactly the "a task asks for what it needs"
  this harness wants, without placement groups or actors.

Design:

- Network exposure: every cluster this module starts (``LocalCluster``, dask-cuda's
  ``LocalCUDACluster``, the multi-GPU ``SpecCluster``) listens on ``127.0.0.1`` only
  (:data:`LOCAL_HOST`), with no dashboard: nothing on the network can reach its scheduler or
  submit work to it. Workers run pickled tasks, so a scheduler must never listen where
  untrusted hosts can connect; an external cluster (``--scheduler``) is the site's to secure
  (Dask's TLS, ``tls://`` addresses). A ``--scheduler`` address is checked for its form and
  probed with a plain TCP connect (:data:`SCHEDULER_CONNECT_S` seconds) before any model loads.
- One task per (method spec × seed), the unit :func:`mosaicquant.harness.runner.run_group`
  computes: quantize once, run each pending suite, write each record with the same atomic
  writer as a local sweep (:func:`mosaicquant.harness.results.save_record`), into the
  results directory, which must therefore be on a file system the workers share. A sweep
  interrupted on the cluster resumes like a local one: a rerun skips every ``ok`` record.
- A task asks for ``{"GPU": gpus_per_cell}`` when the sweep's device is CUDA and for
  ``{"CPU": 1}`` otherwise. Every worker this module starts offers ``CPU=1`` or
  ``GPU=<its GPUs>`` and one thread, so a worker process runs one cell at a time (methods
  seed the process-global torch generator, so two cells must not share a process at once).
  Workers of an external cluster must declare these resources
  (``dask worker ADDR --nthreads 1 --resources "CPU=1"``, ``dask cuda worker ADDR --resources "GPU=1"``);
  a sweep whose cells no worker can take stops before submitting anything.
- Tasks are serialized with cloudpickle by this module, so methods and suites registered
  in a script or notebook travel by value; each worker loads the model, tokenizer and
  calibration/test tokens itself and keeps them for later tasks of the same sweep
  (one cached sweep per worker process).
- The client keeps at most as many tasks in flight as the workers have slots, so a task
  is only ever placed on a worker that can start it at once.
- Lost workers: the clusters this module starts set the scheduler's ``allowed-failures`` to 0
  and submit with ``retries=0``. A worker that dies (killed, out of memory, crashed) fails
  only the task it was running: its cells that have no ``ok`` record are written as failed
  (stage ``"worker"``, an error saying the worker died), the nanny restarts the worker, the
  sweep goes on, and a rerun redoes those cells. Dask's default (3 allowed failures) would
  silently rerun a cell that kills its worker, e.g. by running out of memory, three times
  before saying so. On an external cluster its own ``allowed-failures`` applies: a
  recomputed task skips the cells the lost attempt already finished, so a record is never
  written twice.
- Multi-GPU cells (``gpus_per_cell > 1``): each worker holds a disjoint group of GPUs
  (``CUDA_VISIBLE_DEVICES`` per worker through a ``SpecCluster`` of nannies, since
  dask-cuda's rotation of the device list gives overlapping groups) and loads the model
  with ``device_map="auto"`` across them (:func:`mosaicquant.harness.models.load_model`).

Example:
    >>> settings = ExecutorSettings(kind="dask", workers=2)
    >>> run_sweep(spec, executor=settings)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mosaicquant.errors import MosaicQuantError, UserInputError, unknown_name
from mosaicquant.harness import shapes as shapes_mod
from mosaicquant.harness.results import save_record
from mosaicquant.harness.runner import (
    CellOutcome, GroupTask, SweepResult, SweepState, failure_record, is_finished, run_group,
)
from mosaicquant.harness.spec import RunSpec

__all__ = [
    "EXECUTORS",
    "DEFAULT_CPU_WORKERS",
    "ExecutorSettings",
    "LocalExecutor",
    "DaskExecutor",
    "make_executor",
    "parse_scheduler_address",
    "check_scheduler_reachable",
    "task_resources",
    "gpu_groups",
    "visible_gpus",
]

EXECUTORS = ("local", "dask")
# CPU workers started when --workers is not given: each holds a float model and a quantized copy.
DEFAULT_CPU_WORKERS = max(1, min(4, os.cpu_count() or 1))
# Seconds to wait for the workers of a cluster to connect.
WORKER_WAIT_S = 180
# Seconds to wait for a running scheduler (--scheduler) to accept a connection.
SCHEDULER_CONNECT_S = 5.0
# Address the clusters started here listen on: this machine only, not the network.
LOCAL_HOST = "127.0.0.1"
SCHEDULER_PROTOCOLS = ("tcp", "tls", "ucx", "ws", "wss", "inproc")
_DEFAULT_SCHEDULER_PORT = 8786
_ADDRESS = re.compile(r"(?:(?P<protocol>[a-z]+)://)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)"
                      r"(?::(?P<port>[0-9]+))?/?")


def parse_scheduler_address(address: str) -> tuple[str, str, int | None]:
    """Split a Dask scheduler address into ``(protocol, host, port)``.

    Args:
        address: ``[protocol://]host[:port]``, e.g. ``tcp://10.0.0.5:8786``; ``host:port``
            means tcp. An ``inproc://`` address has no port.

    Returns:
        The protocol, the host (IPv6 in brackets as given) and the port (8786 where not given
        for tcp and tls; None for inproc).

    Raises:
        UserInputError: the address does not have that form, names another protocol, or a port
            outside 1..65535.

    Example:
        >>> parse_scheduler_address("tcp://h:8786")
        ('tcp', 'h', 8786)
    """
    allowed = f"use [protocol://]host[:port], e.g. tcp://host:8786 (protocols: {', '.join(SCHEDULER_PROTOCOLS)})"
    match = _ADDRESS.fullmatch(address.strip())
    if match is None:
        raise UserInputError(f"scheduler={address!r} is not a Dask scheduler address: {allowed}")
    protocol = match["protocol"] or "tcp"
    if protocol not in SCHEDULER_PROTOCOLS:
        raise UserInputError(f"scheduler={address!r}: unknown protocol {protocol!r}: {allowed}")
    if protocol == "inproc":
        return protocol, match["host"], None
    port = int(match["port"]) if match["port"] else _DEFAULT_SCHEDULER_PORT
    if not 1 <= port <= 65535:
        raise UserInputError(f"scheduler={address!r}: port {port} is out of range: allowed 1..65535")
    return protocol, match["host"], port


def check_scheduler_reachable(address: str, timeout_s: float = SCHEDULER_CONNECT_S) -> None:
    """Fail fast when nothing accepts a connection at a scheduler address (a plain socket connect).

    Args:
        address: a scheduler address (see :func:`parse_scheduler_address`).
        timeout_s: how long the connection may take.

    Raises:
        UserInputError: the host does not resolve, refuses or does not answer within ``timeout_s``,
            naming the address.
    """
    protocol, host, port = parse_scheduler_address(address)
    if port is None or protocol == "ucx":
        return  # no TCP port to probe; the client reports what it finds
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            pass
    except OSError as exc:
        reason = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc) or type(exc).__name__)
        raise UserInputError(
            f"scheduler={address!r}: no Dask scheduler reachable at {host}:{port} within {timeout_s:g} s "
            f"({reason}); start one ('dask scheduler') or check the address") from None


def _check_count(name: str, value: Any, minimum: int = 1) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise UserInputError(f"{name}={value!r} is not allowed: use an integer >= {minimum}")


@dataclass(frozen=True)
class ExecutorSettings:
    """How a sweep's cells are run.

    Attributes:
        kind: ``"local"`` (default: every cell in this process, in plan order) or
            ``"dask"`` (each method spec × seed is one Dask task).
        workers: dask, CPU sweeps: worker processes of a ``LocalCluster`` started for the
            sweep (default :data:`DEFAULT_CPU_WORKERS`), one thread each.
        gpus: dask, CUDA sweeps: GPUs of this machine to use (default: all visible); one
            dask-cuda worker per GPU, or one per ``gpus_per_cell`` GPUs.
        gpus_per_cell: GPUs each cell holds; above 1 the model is loaded with
            ``device_map="auto"`` over them (needs ``device='cuda'``).
        scheduler: dask: address of a running scheduler (``tcp://host:8786``) whose workers
            run the cells instead of a cluster started here.

    Raises:
        UserInputError: unknown kind (did-you-mean), a count below 1, or options that only
            the ``dask`` executor takes given with ``local``.

    Example:
        >>> ExecutorSettings(kind="dask", gpus=4, gpus_per_cell=2).device_map
        'auto'
    """

    kind: str = "local"
    workers: int | None = None
    gpus: int | None = None
    gpus_per_cell: int = 1
    scheduler: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise unknown_name("executor", str(self.kind), EXECUTORS)
        _check_count("workers", self.workers)
        _check_count("gpus", self.gpus)
        _check_count("gpus_per_cell", self.gpus_per_cell)
        if self.scheduler is not None and (not isinstance(self.scheduler, str) or not self.scheduler.strip()):
            raise UserInputError(f"scheduler={self.scheduler!r} is not allowed: use an address like tcp://host:8786")
        if self.scheduler is not None:
            parse_scheduler_address(self.scheduler)
        if self.kind == "local":
            given = [f"{name}={value!r}" for name, value in
                     (("workers", self.workers), ("gpus", self.gpus), ("scheduler", self.scheduler)) if value is not None]
            if given:
                raise UserInputError(f"{', '.join(given)} only apply to executor 'dask' (executor is 'local')")
        if self.scheduler is not None and (self.workers is not None or self.gpus is not None):
            raise UserInputError("scheduler= connects to a running cluster: workers= and gpus= only size a cluster "
                                 "started here; give one or the other")

    @property
    def device_map(self) -> str | None:
        """``"auto"`` when a cell holds more than one GPU, else ``None``."""
        return "auto" if self.gpus_per_cell > 1 else None


def task_resources(spec: RunSpec, settings: ExecutorSettings) -> dict[str, float]:
    """The Dask worker resources one task of ``spec`` asks for.

    Args:
        spec: the sweep (its device decides).
        settings: the executor settings (``gpus_per_cell``).

    Returns:
        ``{"GPU": gpus_per_cell}`` for a CUDA device, ``{"CPU": 1}`` otherwise.
    """
    if spec.device.startswith("cuda"):
        return {"GPU": settings.gpus_per_cell}
    return {"CPU": 1}


def visible_gpus() -> list[str]:
    """The GPU ids this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else ``0..n-1``."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [item.strip() for item in listed.split(",") if item.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_groups(devices: list[str], gpus: int, gpus_per_cell: int) -> list[list[str]]:
    """Split the first ``gpus`` devices into disjoint groups of ``gpus_per_cell``, one per worker.

    Args:
        devices: GPU ids as ``CUDA_VISIBLE_DEVICES`` lists them.
        gpus: how many of them to use.
        gpus_per_cell: GPUs per worker.

    Returns:
        ``gpus // gpus_per_cell`` lists of ids, in order.

    Raises:
        UserInputError: more GPUs asked than listed, or ``gpus`` not a multiple of ``gpus_per_cell``.

    Example:
        >>> gpu_groups(["0", "1", "2", "3"], 4, 2)
        [['0', '1'], ['2', '3']]
    """
    if gpus > len(devices):
        raise UserInputError(f"gpus={gpus} but this machine shows {len(devices)} GPU(s) ({','.join(devices) or 'none'})")
    if gpus % gpus_per_cell:
        raise UserInputError(f"gpus={gpus} is not a multiple of gpus_per_cell={gpus_per_cell}: "
                             "every worker holds gpus_per_cell GPUs")
    return [devices[i:i + gpus_per_cell] for i in range(0, gpus, gpus_per_cell)]


class LocalExecutor:
    """Every task in this process, in plan order, sharing one :class:`SweepState`."""

    def __init__(self, spec: RunSpec, settings: ExecutorSettings):
        self.spec = spec
        self.settings = settings

    def run(self, tasks: list[GroupTask], result: SweepResult, log: Callable[[str], None] = print) -> None:
        """Run ``tasks`` and add their outcomes to ``result``."""
        state = SweepState(self.spec, log)
        if self.settings.device_map is None and not shapes_mod.is_shape_model(self.spec.model):
            # a shape model is built on the device by each task instead. A model the harness refuses
            # (non-finite weights, a missing built-in file) stops the sweep with its one-line error; one
            # that fails to load otherwise fails every task's cells, recorded by run_group as on a Dask worker
            try:
                state.loaded()
            except MosaicQuantError:
                raise
            except Exception:  # noqa: BLE001 - kept by the state, recorded per cell
                pass
        for task in tasks:
            for outcome in run_group(task, state, log):
                result.add(outcome)


# --------------------------------------------------------------------------- worker side

# One cached sweep per worker process: (model, dtype, corpus, calibration settings, device) -> state.
_WORKER_STATES: dict[tuple, SweepState] = {}


def _state_key(spec: RunSpec) -> tuple:
    return (spec.model, spec.dtype, spec.corpus, spec.calib_samples, spec.calib_seqlen, spec.device)


def _run_on_worker(payload: bytes) -> tuple[list[CellOutcome], list[str]]:
    """Task body on a Dask worker: unpickle the task, run it against the process's cache."""
    import cloudpickle

    task: GroupTask = cloudpickle.loads(payload)
    key = _state_key(task.spec)
    state = _WORKER_STATES.get(key)
    if state is None:
        _WORKER_STATES.clear()  # a new sweep: drop the previous model before loading the next
        state = SweepState(task.spec)
        _WORKER_STATES[key] = state
    lines: list[str] = []
    state.log = lines.append
    outcomes = run_group(task, state, lines.append)
    return outcomes, lines


# --------------------------------------------------------------------------- client side


def _import_distributed():
    try:
        import distributed
    except ImportError:
        raise UserInputError("executor 'dask' needs the 'distributed' package: pip install 'mosaicquant[dask]'") from None
    return distributed


class DaskExecutor:
    """Each task on a Dask worker: a cluster started here, or a running one (``scheduler``)."""

    def __init__(self, spec: RunSpec, settings: ExecutorSettings):
        self.spec = spec
        self.settings = settings
        self.resources = task_resources(spec, settings)

    # ---- clusters

    def _cpu_cluster(self, distributed):
        return distributed.LocalCluster(n_workers=self.settings.workers or DEFAULT_CPU_WORKERS, threads_per_worker=1,
                                        processes=True, resources={"CPU": 1}, dashboard_address=None,
                                        host=LOCAL_HOST)

    def _gpu_cluster(self, distributed):
        devices = visible_gpus()
        gpus = self.settings.gpus or len(devices)
        per_cell = self.settings.gpus_per_cell
        groups = gpu_groups(devices, gpus, per_cell)
        if per_cell == 1:
            try:
                from dask_cuda import LocalCUDACluster
            except ImportError:
                raise UserInputError("executor 'dask' on GPUs starts one worker per GPU with dask-cuda: "
                                     "pip install 'mosaicquant[dask]'") from None
            return LocalCUDACluster(CUDA_VISIBLE_DEVICES=[group[0] for group in groups], n_workers=len(groups),
                                    threads_per_worker=1, resources={"GPU": 1}, dashboard_address=None,
                                    host=LOCAL_HOST)
        workers = {
            f"gpus-{'-'.join(group)}": {
                "cls": distributed.Nanny,
                "options": {"nthreads": 1, "resources": {"GPU": per_cell}, "host": LOCAL_HOST,
                            "env": {"CUDA_VISIBLE_DEVICES": ",".join(group)}},
            }
            for group in groups
        }
        scheduler = {"cls": distributed.Scheduler, "options": {"dashboard_address": None, "host": LOCAL_HOST}}
        return distributed.SpecCluster(workers=workers, scheduler=scheduler)

    @contextlib.contextmanager
    def _client(self, log: Callable[[str], None]) -> Iterator[Any]:
        distributed = _import_distributed()
        import dask

        if self.settings.scheduler is not None:
            check_scheduler_reachable(self.settings.scheduler)
            client = distributed.Client(self.settings.scheduler, timeout=max(30.0, 6 * SCHEDULER_CONNECT_S))
            try:
                client.wait_for_workers(1, timeout=WORKER_WAIT_S)
                log(f"[mosaicquant] dask: connected to {self.settings.scheduler}")
                yield client
            finally:
                client.close()
            return
        with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
            if self.spec.device.startswith("cuda"):
                cluster = self._gpu_cluster(distributed)
            else:
                cluster = self._cpu_cluster(distributed)
        try:
            client = distributed.Client(cluster)
            try:
                n_workers = len(cluster.worker_spec)
                client.wait_for_workers(n_workers, timeout=WORKER_WAIT_S)
                log(f"[mosaicquant] dask: {type(cluster).__name__} with {n_workers} worker(s), "
                    f"each task asks for {self.resources}")
                yield client
            finally:
                client.close()
        finally:
            cluster.close()

    def _slots(self, client) -> int:
        """How many tasks the connected workers can run at once, given their resources."""
        try:
            info = client.scheduler_info(n_workers=-1)
        except TypeError:  # versions before the n_workers argument list every worker
            info = client.scheduler_info()
        slots = 0
        for worker in info.get("workers", {}).values():
            offered = worker.get("resources", {}) or {}
            slots += int(min(offered.get(name, 0) // amount for name, amount in self.resources.items()))
        if slots == 0:
            raise UserInputError(
                f"no worker of the Dask cluster offers the resources a cell needs ({self.resources}): start workers "
                "with one thread and --resources \"CPU=1\" for CPU sweeps or \"GPU=1\" (one per GPU, "
                "dask cuda worker) for CUDA sweeps")
        return slots

    # ---- the sweep

    def run(self, tasks: list[GroupTask], result: SweepResult, log: Callable[[str], None] = print) -> None:
        """Run ``tasks`` on the cluster, at most one per worker slot in flight; add outcomes to ``result``.

        Raises:
            UserInputError: ``distributed`` (or dask-cuda) is missing, or no worker offers the
                resources the cells need.
        """
        distributed = _import_distributed()
        import cloudpickle

        with self._client(log) as client:
            slots = self._slots(client)
            queue = list(tasks)
            in_flight: dict[Any, GroupTask] = {}
            completed = distributed.as_completed()

            def submit(task: GroupTask) -> None:
                key = f"mosaicquant-{task.label}-s{task.seed}-{uuid.uuid4().hex[:8]}"
                future = client.submit(_run_on_worker, cloudpickle.dumps(task), key=key, resources=self.resources,
                                       pure=False, retries=0)
                in_flight[future] = task
                completed.add(future)

            while queue and len(in_flight) < slots:
                submit(queue.pop(0))
            try:
                for future in completed:
                    task = in_flight.pop(future)
                    try:
                        outcomes, lines = future.result()
                    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - the cell records it
                        self._record_lost(task, exc, result, log)
                    else:
                        for line in lines:
                            log(line)
                        for outcome in outcomes:
                            result.add(outcome)
                    if queue:
                        submit(queue.pop(0))
            except KeyboardInterrupt:
                client.cancel(list(in_flight))
                raise

    def _record_lost(self, task: GroupTask, exc: BaseException, result: SweepResult,
                     log: Callable[[str], None]) -> None:
        from distributed.scheduler import KilledWorker

        if isinstance(exc, KilledWorker):
            message = ("the worker running this cell died before it finished (killed, out of memory or crashed); "
                       f"a rerun of the sweep redoes it. Scheduler: {exc}")
        else:
            message = f"the task of this cell failed on its worker: {type(exc).__name__}: {exc}"
        for cell in task.cells:
            if is_finished(cell.path):
                result.written.append(cell.path)  # the lost attempt had finished this one
                continue
            save_record(cell.path, failure_record(self.spec, cell, "worker", exc, message))
            result.failed.append(cell.path)
            log(f"[mosaicquant]   FAILED {task.label} / {cell.suite.label}: {message.split('. Scheduler')[0]}")


def make_executor(settings: ExecutorSettings, spec: RunSpec) -> LocalExecutor | DaskExecutor:
    """The executor for ``settings``, checked against the sweep's device.

    Args:
        settings: executor settings.
        spec: the sweep.

    Returns:
        A :class:`LocalExecutor` or :class:`DaskExecutor` (``run(tasks, result, log)``).

    Raises:
        UserInputError: settings that do not fit the device (``gpus`` or ``gpus_per_cell > 1``
            on the CPU, ``workers`` on CUDA, ``cuda:N`` under dask, more GPUs than visible),
            a missing ``distributed`` package, or a ``scheduler`` address where nothing answers
            within :data:`SCHEDULER_CONNECT_S` seconds.
    """
    cuda = spec.device.startswith("cuda")
    if settings.gpus_per_cell > 1:
        if spec.device != "cuda":
            raise UserInputError(f"gpus_per_cell={settings.gpus_per_cell} spreads a model over several GPUs: "
                                 f"it needs device='cuda' (got {spec.device!r})")
        if settings.kind == "local" and settings.gpus_per_cell > torch.cuda.device_count():
            raise UserInputError(f"gpus_per_cell={settings.gpus_per_cell} but {torch.cuda.device_count()} GPU(s) "
                                 "are visible")
    if settings.kind == "local":
        return LocalExecutor(spec, settings)
    _import_distributed()
    if cuda and spec.device != "cuda":
        raise UserInputError(f"device={spec.device!r} with executor 'dask': each cell runs on the GPU(s) its "
                             "worker holds; use device 'cuda'")
    if settings.gpus is not None and not cuda:
        raise UserInputError(f"gpus={settings.gpus} starts GPU workers: it needs device 'cuda' (got {spec.device!r})")
    if settings.workers is not None and cuda:
        raise UserInputError(f"workers={settings.workers} starts CPU workers: with device 'cuda' use gpus= "
                             "(one worker per GPU)")
    if cuda and settings.scheduler is None:
        gpu_groups(visible_gpus(), settings.gpus or len(visible_gpus()), settings.gpus_per_cell)
    if settings.scheduler is not None:
        check_scheduler_reachable(settings.scheduler)
    return DaskExecutor(spec, settings)
