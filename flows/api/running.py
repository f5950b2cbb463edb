"""Running a config from Python (`pt2flow.flows.api.run`), and the steps `pt2flow run` and
`pt2flow serve` share with it: loading the config with overrides, refusing what cannot work,
opening the store, and running the fleet (from the index alone when nothing is left to build).
torch and Prefect are imported only once the config and the store have been checked."""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping, Sequence

from pt2flow.flows.options import UsageError, merge_options

CREDENTIALS_IN_URL = (
    "the store URL holds credentials, which would be saved in Prefect's flow parameters; "
    "pass them with --storage-option, the config's storage_options or the environment"
)
RUNNERS = ("local", "process", "dask")
# how long `run --runner dask --dask-address ADDR` waits for the scheduler to answer before anything
# runs; short, so a wrong address is a quick usage error rather than Dask's 30 s connect timeout
DASK_CONNECT_TIMEOUT_ENV = "PT2FLOW_DASK_CONNECT_TIMEOUT_S"
DEFAULT_DASK_CONNECT_TIMEOUT_S = 10.0

if TYPE_CHECKING:
    from prefect.states import State

    from pt2flow.flows.config.models import Pipeline
    from pt2flow.flows.engine.common.documents import RunDocument
    from pt2flow.flows.engine.orchestrator.fleet_plan import RunParameters
    from pt2flow.storage import ArtifactStore

# progress(store, run_id, model names, stages) -> a context manager shown while the fleet runs
Progress = Callable[["ArtifactStore", str, list[str], Sequence[str]], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class PreparedRun:
    """A run checked and ready to start (prepare_run): its parameters (the fleet flow's, built
    once), the config loaded once with the run's overrides, and the store opened."""

    parameters: RunParameters
    config: Pipeline
    store: ArtifactStore


def load_for_run(
    config: str,
    *,
    only: Sequence[str] = (),
    stages: Sequence[str] | None = None,
    workers: int | None = None,
    runner: str = "local",
    dask_address: str | None = None,
    no_worker_timeout_s: float | None = None,
) -> Pipeline:
    """The config with `only`/`stages` applied; raises ConfigError or UsageError."""
    from pt2flow.flows.config import apply_overrides, load_config

    if runner not in RUNNERS:
        raise UsageError(f"runner must be one of {', '.join(RUNNERS)}, not {runner!r}")
    loaded = apply_overrides(load_config(config), only=tuple(only or ()), stages=list(stages) if stages else None)
    if workers is not None and workers < 1:
        raise UsageError("--workers must be at least 1")
    from pt2flow.flows.engine.orchestrator.pool import models_per_worker, workers_from_environment

    try:
        models_per_worker()
        if workers is None:
            workers_from_environment()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if dask_address and runner != "dask":
        raise UsageError("--dask-address needs --runner dask")
    if no_worker_timeout_s is not None and runner != "dask":
        raise UsageError("--no-worker-timeout needs --runner dask")
    if no_worker_timeout_s is not None and not no_worker_timeout_s > 0:
        raise UsageError("--no-worker-timeout must be more than 0 seconds")
    return loaded


def dask_connect_timeout() -> float:
    """Seconds to wait for a Dask scheduler: $PT2FLOW_DASK_CONNECT_TIMEOUT_S, else 10."""
    raw = os.environ.get(DASK_CONNECT_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_DASK_CONNECT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise UsageError(f"{DASK_CONNECT_TIMEOUT_ENV} must be a number of seconds more than 0, not {raw!r}")
    return value


def check_cluster(runner: str, dask_address: str | None) -> None:
    """With `--runner dask --dask-address ADDR`, the scheduler must answer before anything runs,
    a run the index settles alone included: UsageError naming the address and how long it was
    waited for (dask_connect_timeout). Without an address the run starts its own LocalCluster."""
    if runner != "dask" or not dask_address:
        return
    import asyncio
    import time

    import distributed.comm  # noqa: F401  (imported before the clock starts)

    timeout = dask_connect_timeout()
    started = time.monotonic()
    try:
        asyncio.run(_reach_scheduler(dask_address, timeout))
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the same answer to the user
        waited = time.monotonic() - started
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, ValueError):  # distributed could not parse it
            raise UsageError(
                f"--dask-address {dask_address} is not the address of a Dask scheduler (tcp://HOST:PORT): {reason}"
            ) from None
        raise UsageError(
            f"no Dask scheduler answered at --dask-address {dask_address} within {waited:.1f} s "
            f"(limit {timeout:g} s, ${DASK_CONNECT_TIMEOUT_ENV}): {type(exc).__name__}: {reason}"
        ) from None


async def _reach_scheduler(address: str, timeout: float) -> None:
    """Open one Dask comm to `address` (its handshake included) and ask it for its identity, as
    a client's first call does: only a Dask scheduler answers. A comm, not a Client: a Client
    that failed half-way would try to close itself again when Python exits."""
    import asyncio

    from distributed.comm import connect

    comm = await connect(address, timeout=timeout)
    try:
        await comm.write({"op": "identity", "reply": True})
        answer = await asyncio.wait_for(comm.read(), timeout)
    finally:
        await comm.close()
    if not isinstance(answer, dict) or answer.get("type") != "Scheduler":
        raise OSError(f"the server there is not a Dask scheduler (it says {str(answer)[:80]!r})")


def refuse_credentials(store_url: str) -> None:
    """A store URL with credentials would be saved in Prefect's flow parameters: refused."""
    from pt2flow.storage.urls import redact_url

    if redact_url(store_url) != store_url:
        raise UsageError(CREDENTIALS_IN_URL)


def open_checked_store(store_url: str, config: Pipeline, storage_options: Mapping[str, Any] | None) -> ArtifactStore:
    """Set the run's storage options (the config's, then `storage_options` over them) in this
    process' environment and open the store; UsageError if it is unreachable."""
    from pt2flow.flows.engine.common import stores
    from pt2flow.storage.urls import redact_url

    stores.set_storage_options(store_url, merge_options(dict(config.storage_options), dict(storage_options or {})))
    try:
        store = stores.open_store(store_url)
        store.index.files()  # fail fast on an unreachable store
    except Exception as exc:
        raise UsageError(f"store {redact_url(store_url)}: {exc}") from exc
    refuse_unwritable_store(store)
    return store


def refuse_unwritable_store(store: ArtifactStore) -> None:
    """A local store this user cannot write is a setup error, found before anything runs (UsageError:
    the CLI's exit 2, DESIGN §4), not a failure of every model (`run`, `serve`, `upgrade-check`): its folder is made if missing, and a probe file is
    created there and removed. Other stores (s3://, memory://) are left to the run's own writes."""
    from pt2flow.storage.urls import is_local

    if not is_local(store.fs):
        return
    probe = os.path.join(store.root, f".pt2flow-write-probe-{os.getpid()}")
    try:
        os.makedirs(store.root, exist_ok=True)
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        os.unlink(probe)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        fix = (
            "a file stands where the store's folder (or one above it) would go: move it"
            if exc.errno in (errno.ENOTDIR, errno.EEXIST)
            else "make that folder writable for this user"
        )
        raise UsageError(
            f"the store {store.root} cannot be written: {exc.strerror or exc}{where}; nothing ran. "
            f"To fix: {fix}, or give --store (or the config's store:) a folder you can write"
        ) from exc


def prepare_run(
    config: str | os.PathLike[str],
    *,
    store: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    only: Sequence[str] = (),
    stages: Sequence[str] | None = None,
    workers: int | None = None,
    runner: str = "local",
    dask_address: str | None = None,
    no_worker_timeout_s: float | None = None,
    force: bool = False,
    verify_sources: bool = False,
    retry_failed: bool = False,
    python: str | None = None,
) -> PreparedRun:
    """Every check `run` makes before anything runs (the config, the arguments, the store URL,
    the workers' interpreter, the Dask scheduler, the store), then the run's parameters: the one
    place they are built (`pt2flow run` and `api.run`). Raises ConfigError or UsageError."""
    from pt2flow.flows.config import resolve_store_url
    from pt2flow.flows.engine.common.context import new_run_id
    from pt2flow.flows.engine.orchestrator.fleet_plan import RunParameters

    loaded = load_for_run(
        str(config),
        only=only,
        stages=stages,
        workers=workers,
        runner=runner,
        dask_address=dask_address,
        no_worker_timeout_s=no_worker_timeout_s,
    )
    store_url = resolve_store_url(store or loaded.store)
    refuse_credentials(store_url)
    chosen_python = check_python(python or loaded.python, runner)
    check_cluster(runner, dask_address)
    opened = open_checked_store(store_url, loaded, storage_options)
    parameters = RunParameters(
        config_path=os.path.abspath(config),
        store=store_url,
        only=tuple(only) or None,
        stages=tuple(loaded.stages),
        force=force,
        runner=runner,
        workers=workers,
        dask_address=dask_address,
        no_worker_timeout_s=no_worker_timeout_s,
        run_id=new_run_id(),
        retry_failed=retry_failed,
        python=chosen_python,
        verify_sources=verify_sources,
    )
    return PreparedRun(parameters, loaded, opened)


def run(
    config: str | os.PathLike[str],
    *,
    store: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    only: Sequence[str] = (),
    stages: Sequence[str] | None = None,
    workers: int | None = None,
    runner: str = "local",
    dask_address: str | None = None,
    no_worker_timeout_s: float | None = None,
    force: bool = False,
    verify_sources: bool = False,
    retry_failed: bool = False,
    python: str | None = None,
    progress: Progress | None = None,
) -> RunDocument:
    """Run a config as `pt2flow run` does; returns the typed run document (RunDocument).

    `python`: the interpreter (or virtualenv folder) the workers run in, instead of the config's
    `python:` or this one (`run --python`). Raises ConfigError (a bad config) or UsageError (bad
    arguments, an unreachable store, an interpreter without pt2flow) before anything runs; a
    model that fails is in the document, not an exception."""
    from pt2flow.flows.engine.common.documents import RunDocument

    prepared = prepare_run(
        config,
        store=store,
        storage_options=storage_options,
        only=only,
        stages=stages,
        workers=workers,
        runner=runner,
        dask_address=dask_address,
        no_worker_timeout_s=no_worker_timeout_s,
        force=force,
        verify_sources=verify_sources,
        retry_failed=retry_failed,
        python=python,
    )
    return RunDocument.model_validate(execute(prepared, progress=progress))


def execute(prepared: PreparedRun, *, progress: Progress | None = None) -> dict[str, Any]:
    """Run the fleet flow with the run's parameters (fleet_flow's) on its loaded config; the run
    document as JSON-ready dict."""
    from pt2flow.flows.engine.services import prefect_runtime

    parameters, config, store = prepared.parameters, prepared.config, prepared.store
    if not parameters.force and not parameters.verify_sources and not os.environ.get("PT2FLOW_ALWAYS_PREFECT"):
        document = nothing_to_build(parameters, config)
        if document is not None:
            return with_failure_groups(document, store)

    def while_the_server_starts() -> None:
        """The workers import torch, and this process the fleet flow's modules (Prefect's flow and
        task engines: about a second), while the Prefect server boots (3-5 s on 2 cores)."""
        if parameters.runner != "dask":
            start_workers(parameters.workers, len(config.models), parameters.python)
        import pt2flow.flows.fleet  # noqa: F401

    with prefect_runtime.prefect_api(while_starting=while_the_server_starts):
        from pt2flow.flows.engine.orchestrator.fleet_plan import loaded_config
        from pt2flow.flows.fleet import fleet_flow

        run_id = str(parameters.run_id)
        shown = (
            progress(store, run_id, [m.name for m in config.models], config.stages)
            if progress
            else contextlib.nullcontext()
        )
        with shown, loaded_config(run_id, config):
            state: State[Any] = fleet_flow(**parameters.flow_parameters(), return_state=True)  # type: ignore[assignment]  # sync flow: a State, not an Awaitable
        result = state.result(raise_on_failure=False)
    if isinstance(result, OSError) and parameters.runner == "dask":  # the cluster went away after check_cluster
        raise UsageError(
            f"the Dask cluster ({parameters.dask_address or 'a LocalCluster'}) could not be used: {result}"
        )
    if not isinstance(result, dict):
        raise RuntimeError(f"the fleet flow ended without a result: {result!r}")
    return with_failure_groups(result, store)


def with_failure_groups(document: dict[str, Any], store: ArtifactStore) -> dict[str, Any]:
    """The run document with its failures grouped by root cause against the run `report` pairs
    it with (`failure_groups`, flows/report/failures.py). Best effort: the run is done, and a
    grouping problem only leaves the groups out."""
    import logging

    from pt2flow.flows.report.failures import run_groups

    if "failure_groups" in document:
        return document
    try:
        groups = run_groups(store.index, document["run_id"], store_url=store.url)
    except Exception as exc:  # noqa: BLE001 - the groups are a view of a finished run
        logging.getLogger("pt2flow").warning("could not group the run's failures: %s: %s", type(exc).__name__, exc)
        return document
    if groups:
        document["failure_groups"] = groups
    return document


def start_workers(workers: int | None, models: int, python: str | None = None) -> None:
    from pt2flow.flows.engine.orchestrator.pool import default_workers, start_pool

    start_pool(workers or default_workers(models), python)


def check_python(python: str | None, runner: str = "local") -> str | None:
    """The workers' interpreter as an absolute executable path (None: this one), checked before
    anything runs: UsageError when it lacks pt2flow or speaks another worker protocol."""
    if python is None:
        return None
    from pt2flow.flows.engine.environment.interpreter import describe

    if runner == "dask":
        raise UsageError("--python runs workers on this machine: use it with the local runner, not dask")
    return describe(python).python


def nothing_to_build(parameters: RunParameters, config: Pipeline) -> dict[str, Any] | None:
    """When every model is already built (each stage's key has an ok record whose blob verifies),
    settle the run from the index without starting Prefect: the cached records are written under
    this run's id, as a flow would. None when there is work to do."""
    from pt2flow.flows.engine.common import stores
    from pt2flow.flows.engine.orchestrator.fleet_plan import NeedsFlow, fleet_context, settle_fleet
    from pt2flow.storage.leases import RunLease

    loaded, ctx = fleet_context(parameters, config)
    from pt2flow.storage import StorageError

    try:
        with RunLease(stores.open_store(ctx.store_url), ctx.run_id):  # it reads the index and records hits
            return settle_fleet(loaded, ctx)
    except NeedsFlow:
        return None
    except StorageError:  # the store cannot be written (its lease could not be put): the flow reports it per model
        return None
