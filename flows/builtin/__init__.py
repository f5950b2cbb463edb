"""pt2flow's own stages, one module each (docs/architecture.md §2, "A stage is one module").

Every public module here that defines `STAGE` is a stage: its declaration (flows/pipeline/stage.py)
beside its compute function, its key, its repro template, how `pt2flow audit` rebuilds it and the
device it builds for, when it has them. The registry (flows/pipeline/registry.py) lists the
package; no other file names a stage. A module imports nothing of torch at its top (planning,
queries and reports stay torch-free): the torch work is imported inside its functions, from
pt2flow.stages, and runs in a worker process. A stage from another distribution is written the
same way and joins through the `pt2flow.stages` entry point group.
"""
