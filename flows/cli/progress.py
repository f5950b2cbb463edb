"""Live progress of a fleet run, read from the index records the run appends (works for every runner)."""

from __future__ import annotations

import threading
from typing import Any
from collections.abc import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class FleetProgress:
    """A rich progress bar: models finished (ok / failed / cached) and what each model is doing now.

    Polls the store's index for this run's records every `interval` seconds in a thread; index
    files are immutable and cached per file, so each poll reads only the new ones.
    """

    def __init__(
        self,
        store: Any,
        run_id: str,
        models: Sequence[str],
        stages: Sequence[str],
        console: Console,
        interval: float = 0.5,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.models = list(models)
        self.stages = list(stages)
        self.console = console
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task("export", total=len(self.models), detail="starting")

    def __enter__(self) -> FleetProgress:
        self._progress.start()
        self._thread = threading.Thread(target=self._loop, name="pt2flow-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._progress.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:
                pass  # progress is a convenience; the run's result is what counts

    def poll(self) -> None:
        import pyarrow.compute as pc

        table = self.store.index.read(
            ["model", "stage", "status", "cached", "ended_at"], filter=pc.field("run_id") == self.run_id
        )
        last = self.stages[-1] if self.stages else None
        state: dict[str, dict[str, Any]] = {}
        for row in sorted(table.to_pylist(), key=lambda r: r["ended_at"]):
            entry = state.setdefault(row["model"], {"done": set(), "failed": False, "cached": True})
            if row["status"] != "ok":
                entry["failed"] = True
            if row["stage"] != "source":
                entry["done"].add(row["stage"])
                entry["cached"] = entry["cached"] and bool(row["cached"])
        finished = [m for m, e in state.items() if e["failed"] or (last in e["done"])]
        failed = sum(1 for m in finished if state[m]["failed"])
        cached = sum(1 for m in finished if not state[m]["failed"] and state[m]["cached"])
        running = []
        for model, entry in state.items():
            if model in finished:
                continue
            upcoming = next((s for s in self.stages if s not in entry["done"]), None)
            running.append(f"{model}: {upcoming}")
        detail = f"ok {len(finished) - failed}  failed {failed}  cached {cached}"
        if running:
            detail += "  | " + ", ".join(running[:3]) + (" ..." if len(running) > 3 else "")
        self._progress.update(self._task, completed=len(finished), detail=detail)
