"""What runs in a worker process: its entry point and loop (process.py, started as
`python -m pt2flow.flows.engine.worker.process`), the stage compute functions, verified
artifact loading, audit's rebuild of a record and validate's model check.

May import common/, environment/, flows/config, flows/pipeline, stages and storage; never
orchestrator/, maintenance/, services/, lineage/ or Prefect (an import-linter contract).
"""
