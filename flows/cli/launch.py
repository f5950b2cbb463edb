"""What `run` and `serve` share: the options that say what to run and where, loading the config
with --only/--stages applied, and opening the store they will write. Every check raises
(UsageError, ConfigError: exit 2); the checks themselves are flows/api/running.py's, which the
Python API uses too. torch and Prefect are never imported here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from pt2flow.flows.api.running import refuse_credentials  # noqa: F401  (run and serve check the URL alike)
from pt2flow.flows.cli.support import Args, config_store_options
from pt2flow.flows.options import parse_storage_options

if TYPE_CHECKING:
    from pt2flow.flows.config.models import Pipeline
    from pt2flow.storage import ArtifactStore

CONFIG_HELP = {"CONFIG": "pipeline config (YAML, schema version 1)"}


def fleet_options(fn: Any) -> Any:
    """What to run and where: the options `run` and `serve` share (declared bottom-up)."""
    fn = click.option(
        "--no-worker-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --runner dask: once the cluster has had no worker this long, the models not done fail "
        "(timeout) and the run ends (default: the config's dask.no_worker_timeout_s, 60)",
    )(fn)
    fn = click.option(
        "--python",
        "python",
        metavar="PATH",
        help="run the workers under this Python (an executable or a virtualenv folder with pt2flow installed, e.g. a "
        "candidate torch or transformers); keys and records use its versions (default: the config's python:, else this one)",
    )(fn)
    fn = click.option(
        "--dask-address",
        metavar="ADDR",
        help="scheduler address of an existing Dask cluster (tcp://host:8786); default: a LocalCluster",
    )(fn)
    fn = click.option(
        "--runner",
        type=click.Choice(["local", "process", "dask"]),
        help="local (default; `process` is the same): N supervised worker processes on this machine; "
        "dask: a Dask cluster, each Dask worker with a supervised worker process of its own",
    )(fn)
    fn = click.option(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="models in parallel, each in a supervised worker process (default: $PT2FLOW_WORKERS where set, else one per "
        "core and per 3 GiB of free memory; at most one per model; the run says how many it used)",
    )(fn)
    fn = click.option(
        "--stages", metavar="a,b,...", help="run these stages instead of the config's (pipeline order; trace required)"
    )(fn)
    fn = click.option(
        "--only",
        metavar="NAME[,NAME...]",
        multiple=True,
        callback=comma_list,
        help="run only these models (comma-separated, like --stages; repeatable)",
    )(fn)
    return config_store_options(fn)


def comma_list(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """A repeatable option's values with commas splitting too: `--only a,b` is `--only a --only b`."""
    return tuple(name.strip() for value in values for name in value.split(",") if name.strip())


def stage_list(args: Args) -> list[str] | None:
    """--stages a,b,... as a list (None when not given)."""
    return [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None


def runner_of(args: Args) -> str:
    return args.runner or "local"


def load_for_run(args: Args) -> Pipeline:
    """The config with --only/--stages applied; raises ConfigError or UsageError."""
    from pt2flow.flows.api.running import load_for_run as load

    stages = stage_list(args)
    return load(
        args.config,
        only=args.only or (),
        stages=stages,
        workers=args.workers,
        runner=runner_of(args),
        dask_address=args.dask_address,
        no_worker_timeout_s=args.no_worker_timeout,
    )


def open_checked_store(store_url: str, config: Pipeline, args: Args) -> ArtifactStore:
    """The store of a run, with the config's storage options and --storage-option over them."""
    from pt2flow.flows.api.running import open_checked_store as open_checked

    return open_checked(store_url, config, parse_storage_options(args.storage_option or []))
