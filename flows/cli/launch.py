"""What `run` and `serve` share: the options that say what to run and where, loading the config
with --only/--stages applied, and opening the store they will write. Every check raises
(UsageError, ConfigError: exit 2); torch and Prefect are never imported here."""

from __future__ import annotations

from typing import Any

import click

from pt2flow.flows.cli.options import UsageError, merge_options, parse_storage_options
from pt2flow.flows.cli.support import Args, store_options

CONFIG_HELP = {"CONFIG": "pipeline config (YAML, schema version 1)"}

CREDENTIALS_IN_URL = (
    "the store URL holds credentials, which would be saved in Prefect's flow parameters; "
    "pass them with --storage-option, the config's storage_options or the environment"
)


def fleet_options(fn: Any) -> Any:
    """What to run and where: the options `run` and `serve` share (declared bottom-up)."""
    fn = click.option("--dask-address", metavar="ADDR", help="scheduler address of an existing Dask cluster (tcp://host:8786); default: a LocalCluster")(fn)
    fn = click.option(
        "--runner", type=click.Choice(["local", "process", "dask"]),
        help="local (default; `process` is the same): N supervised worker processes on this machine; "
        "dask: a Dask cluster, each Dask worker with a supervised worker process of its own",
    )(fn)
    fn = click.option(
        "--workers", type=int, default=None, metavar="N",
        help="models in parallel, each in a supervised worker process (default: one per core, at most one per model "
        "and per 3 GiB of free memory; the run says how many it used)",
    )(fn)
    fn = click.option("--stages", metavar="a,b,...", help="run these stages instead of the config's (pipeline order; trace required)")(fn)
    fn = click.option("--only", metavar="NAME", multiple=True, help="run only this model (repeatable)")(fn)
    return store_options(fn)


def runner_of(args: Args) -> str:
    return args.runner or "local"


def load_for_run(args: Args) -> Any:
    """The config with --only/--stages applied; raises ConfigError or UsageError."""
    from pt2flow.flows.config import apply_overrides, load_config

    pipeline = load_config(args.config)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
    pipeline = apply_overrides(pipeline, only=args.only or (), stages=stages)
    if args.workers is not None and args.workers < 1:
        raise UsageError("--workers must be at least 1")
    if args.dask_address and args.runner != "dask":
        raise UsageError("--dask-address needs --runner dask")
    return pipeline


def refuse_credentials(store_url: str) -> None:
    """A store URL with credentials would be saved in Prefect's flow parameters: refused."""
    from pt2flow.storage.urls import redact_url

    if redact_url(store_url) != store_url:
        raise UsageError(CREDENTIALS_IN_URL)


def open_checked_store(store_url: str, pipeline: Any, args: Args) -> Any:
    """Set the run's storage options (config, then --storage-option) in this process'
    environment and open the store; UsageError if it is unreachable."""
    from pt2flow.flows.engine import runtime
    from pt2flow.storage.urls import redact_url

    options = merge_options(dict(pipeline.storage_options), parse_storage_options(args.storage_option or []))
    runtime.set_storage_options(store_url, options)
    try:
        store = runtime.open_store(store_url)
        store.index.files()  # fail fast on an unreachable store
    except Exception as exc:
        raise UsageError(f"store {redact_url(store_url)}: {exc}") from exc
    return store
