"""What the orchestrator and the worker processes share: the run context and its documents
(Outcome, the run's JSON), keys and the environment, a model's inputs and source manifest, a
stage's options, stores (storage options per process), and the worker protocol number.

May import flows/config, flows/pipeline, stages (torch-free at import) and storage, and
environment/; never orchestrator/, worker/, maintenance/, services/, lineage/ or Prefect.
"""
