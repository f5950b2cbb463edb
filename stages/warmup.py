"""What torch does the first time a process exports, done once where workers are forked from.

The first `torch.export.export` in a process imports about 1,300 modules torch loads lazily
(torch._dynamo, torch._functorch, sympy, networkx, ...) and fills torch's own first-use caches:
about 3 s of CPU on this project's 2-core machine, where a tiny model's export then takes 0.2 s.
A worker forked from a fork server (flows/engine/worker/forkserver.py) that did this once starts
with it done, as a reused worker does; a fork server that did not leaves every forked worker to
pay it again on its first model (a test session, `serve`, a pool's replacement workers and
`pt2flow audit`, which builds each model in a worker of its own).

`warm_up` exports a two-layer module with a dynamic batch on the meta device (no tensor is
computed: torch's CPU thread pools stay unstarted, so forking after it is as safe as forking
after `import torch`), decomposes it to core ATen and saves and loads it. It changes no export
that follows: a reused worker's exports follow other exports the same way, and a program's
identity (docs/architecture.md §5) never depends on a worker's history. A torch that fails here
(another version under `--python`) leaves the process as it was: the worker pays the first export
itself.
"""

from __future__ import annotations

import io
import warnings

import torch

from pt2flow.stages.quiet import quiet_torch


def warm_up() -> bool:
    """Do torch's first export, decomposition, save and load once in this process; whether it
    went through (a failure is swallowed: nothing depends on it)."""
    try:
        with quiet_torch(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
                example = torch.empty(2, 4)
            batch = torch.export.Dim("batch", min=1, max=8)
            ep = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
            ep = ep.run_decompositions({}).run_decompositions()
            buffer = io.BytesIO()
            torch.export.save(ep, buffer)
            torch.export.load(io.BytesIO(buffer.getvalue()))
        return True
    except Exception:  # noqa: BLE001 - a warm-up only: the first model's export does the same, or fails with its own reason
        return False
