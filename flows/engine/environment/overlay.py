"""Environments made from another one for `upgrade-check`: the intermediate environments of
`--attribute` (the baseline with some of the candidate's distributions in it, to say which change
breaks a model), and the candidate of `--with REQ` (the baseline with REQ pip-installed).

An overlay is a virtualenv (stdlib `venv`, no pip) whose site-packages holds
  - a `.pth` file that adds the baseline's site-packages after its own (`site.addsitedir`, so
    the baseline's own .pth files, an editable pt2flow among them, are processed too), and
  - the chosen distributions' files, each a symlink to the candidate's installed file (the
    candidate's RECORD lists them), with their .dist-info.
An import, and importlib.metadata, see the overlay's own site-packages first: the chosen
distributions come from the candidate, everything else from the baseline.

Why links to the candidate's files rather than `pip install NAME==VERSION` from the registry:
they are exactly the bits the candidate runs (a local build, a CPU torch wheel from a local
folder, a patched package have no registry twin), they cost no network and no download, and
an overlay of torch takes seconds, not a 700 MB install. Overlays are cached under pt2flow's
cache folder by what they are made of, and re-made when that changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from pt2flow.flows.engine.common.keys import canonical_json
from pt2flow.flows.options import UsageError

OVERLAY_PTH = "_pt2flow_overlay.pth"


def overlay_environment(base: Any, candidate: Any, names: Sequence[str], root: str | os.PathLike[str]) -> str:
    """The python executable of an overlay of `base` (an Interpreter) with the distributions
    `names` (canonical) of `candidate` (an Interpreter) linked in; made under `root` if absent."""
    recipe = {
        "base": base.python,
        "base_site": list(base.site_packages),
        "candidate": candidate.python,
        "dists": {name: [candidate.distributions.get(name), candidate.dist_info.get(name)] for name in sorted(names)},
    }

    def fill(site: str, python: Path) -> None:
        for name in names:
            info = candidate.dist_info.get(name)
            if not info:
                raise UsageError(
                    f"the candidate at {candidate.python} has no installed files of {name} to link into an overlay"
                )
            link_distribution(info, site)

    return _made_once(base, Path(root), f"overlay-{'-'.join(sorted(names))[:60]}", recipe, fill)


def candidate_environment(base: Any, requirements: Sequence[str], root: str | os.PathLike[str]) -> str:
    """The python executable of an overlay of `base` with `requirements` (pip requirement
    specifiers: transformers==5.24.0, a wheel's path) installed into it by pip from the package
    registries, without their dependencies (what the base has serves them; name those that must
    change too). Made once per base and requirement list."""
    recipe = {"base": base.python, "base_site": list(base.site_packages), "requirements": list(requirements)}

    def fill(site: str, python: Path) -> None:
        result = subprocess.run(
            [
                base.python,
                "-m",
                "pip",
                "--python",
                str(python),
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                *requirements,
            ],
            capture_output=True,
            text=True,
            timeout=1800,
            stdin=subprocess.DEVNULL,
        )
        if result.returncode != 0:
            tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise UsageError(f"could not install {' '.join(requirements)} into a candidate environment: {tail}")

    return _made_once(base, Path(root), "candidate", recipe, fill)


def _made_once(base: Any, root: Path, prefix: str, recipe: Mapping[str, Any], fill: Callable[[str, Path], None]) -> str:
    """The python of the overlay `recipe` describes, under `root`: made by `fill(site-packages,
    python)` over a fresh overlay of `base` unless a finished one is there (its marker written
    last); a failed one is removed."""
    folder = root / f"{prefix}-{hashlib.sha256(canonical_json(recipe).encode()).hexdigest()[:16]}"
    python = folder / "bin" / "python"
    marker = folder / "pt2flow-overlay.json"
    if marker.is_file() and python.exists():
        return str(python)
    try:
        fill(_new_overlay(base, folder), python)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    marker.write_text(json.dumps(recipe, indent=1, sort_keys=True))
    return str(python)


def _new_overlay(base: Any, folder: Path) -> str:
    """A fresh virtualenv at `folder` whose site-packages adds `base`'s after its own; returns
    its site-packages."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [base.python, "-m", "venv", "--without-pip", str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    if result.returncode != 0:
        raise UsageError(
            f"could not make an overlay environment in {folder}: {(result.stderr.strip().splitlines() or ['?'])[-1]}"
        )
    site = _site_packages(str(folder / "bin" / "python"))
    Path(site, OVERLAY_PTH).write_text(
        "".join(f"import site; site.addsitedir({path!r})\n" for path in base.site_packages)
    )
    return site


def link_distribution(dist_info: str, site: str) -> int:
    """Symlink every file a distribution installed into site-packages (its RECORD), and its
    .dist-info folder's files, under `site`; returns how many. Scripts outside site-packages
    (../../bin) and byte-code caches are left out."""
    source_root = Path(dist_info).parent
    record = Path(dist_info, "RECORD")
    try:
        entries = [line.split(",", 1)[0] for line in record.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise UsageError(f"{dist_info} has no RECORD to say which files it installed: {exc.strerror or exc}") from None
    linked = 0
    for entry in dict.fromkeys(
        [*entries, *(f"{Path(dist_info).name}/{p.name}" for p in Path(dist_info).iterdir() if p.is_file())]
    ):
        if not entry or entry.startswith("..") or os.path.isabs(entry) or "__pycache__" in entry.split("/"):
            continue
        source = source_root / entry
        target = Path(site) / entry
        if not source.exists() or target.exists() or target.is_symlink():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(source, target)
        linked += 1
    return linked


def _site_packages(python: str) -> str:
    result = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    path = result.stdout.strip()
    if result.returncode != 0 or not path:
        raise UsageError(f"could not ask {python} for its site-packages: {result.stderr.strip()[-300:]}")
    Path(path).mkdir(parents=True, exist_ok=True)
    return path
