"""The long-lived objects of a process kept out of Python's cyclic garbage collector.

A worker imports torch and does a first export before its first model: about 360,000 tracked
objects that live as long as the process. Each full collection walks every one of them, and
exporting allocates enough objects to run one every other model: in one process, 20 tiny MLPs
through export, functionalize and decompose ran 11 full collections of about 0.2 s each, 2.4 s of
their 10.3 s; with those objects frozen, 0.3 s of 7.5 s (517 -> 375 ms a model; docs/benchmarks.md).
`gc.freeze()` moves the objects alive now into a generation the collector never walks; reference
counting still frees them, so what the process frees later is freed as before, and only a cycle
among them that becomes garbage later stays until the process ends (a worker is replaced after
`models_per_worker()` models). Called where start-up ends: in the fork server after its imports
and after its warm-up export (before it forks: a forked worker's collections then also leave the
server's pages unwritten, so they stay shared) and in a worker started on its own after its
imports; then again in a worker between two models (once the last model's
programs are forgotten): what its stages imported on first use (Inductor, ONNX, ExecuTorch,
OpenVINO) and the caches they filled. Without that, one worker through configs/targets.yaml
(4 models, every stage and the benchmark) spent 17 s of its 120 s in 73 full collections walking
them. (The orchestrator's collections cost it 0.44 s over a 40-model run, frozen or not: it
is left as it is.)
"""

from __future__ import annotations

import gc


def freeze_kept_objects() -> None:
    """Collect what is garbage now, then freeze what is alive (`gc.get_freeze_count()` says how
    many objects are frozen: Describe reports it). At start-up, and between two models in a
    worker (the last model's programs forgotten first)."""
    gc.collect()
    gc.freeze()
