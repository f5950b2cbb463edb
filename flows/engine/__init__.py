"""The engine: how a run computes its models' stages, in subpackages by job. See
docs/architecture.md §1 (the map) and §8.

    common/        what both sides share: run context and documents (Outcome), keys and the
                   environment, a model's inputs and source manifest, stage options, stores,
                   the worker protocol number
    orchestrator/  the run path in the orchestrating process: planner, stage keys, the supervisor
                   of worker processes, runner, model flow (Prefect tasks), bookkeeping, records,
                   preflight, the fleet's plan
    worker/        what runs in a worker process: its entry point and loop, the stage compute
                   functions, verified artifact loading, audit's rebuild and validate's model check
    environment/   the interpreter the workers run in, native toolchains, overlay environments
    maintenance/   commands over a store that supervise workers: audit, check-compat, repro
    services/      what a run talks to: Prefect's environment and API server, Dask clusters
    lineage/       OpenLineage run events of every stage

Who may import whom (import-linter contracts in pyproject.toml): the worker side imports
nothing of orchestrator/, maintenance/, services/ or lineage/, and never Prefect; common/ and
environment/ import neither side. The registry of stages is flows/pipeline.
"""
