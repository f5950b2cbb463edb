"""check-compat's Checker (flows/engine/maintenance/compat.py): every artifact is checked in a worker process,
and a worker that imported a module outside torch for one archive (its pytree types) is not used
for the next, so that one archive's imports can never make another one load."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch

from pt2flow.flows.engine.maintenance.compat import Checker
from pt2flow.stages.serialize import serialize
from tests import models

pytestmark = pytest.mark.integration  # check-compat's worker processes


def _archive(module: torch.nn.Module, *args: torch.Tensor) -> bytes:
    return serialize(torch.export.export(module, args), {}).output


def test_a_worker_that_imported_an_archives_modules_is_replaced() -> None:
    from tests.pytree_models import point_output

    plain = _archive(models.tiny_mlp().eval(), torch.randn(2, 8))
    with_types = _archive(point_output(), torch.ones(2))
    checker = Checker(timeout_s=300)
    try:
        first = checker.check("archive", plain, None, 1e-5, 1e-4, "cpu")
        assert first["loads"] is True and "imported" not in first  # the Checker's business, not the report's
        kept = checker.worker
        assert kept is not None and kept.alive  # nothing imported: the same worker goes on
        second = checker.check("archive", with_types, None, 1e-5, 1e-4, "cpu")
        assert second["loads"] is True and second["error_class"] is None
        assert checker.worker is None and not kept.alive  # that worker is gone
        assert checker.torch_version == torch.__version__
        third = checker.check("archive", plain, None, 1e-5, 1e-4, "cpu")
        assert third["loads"] is True and checker.worker is not None and checker.worker.pid != kept.pid
    finally:
        checker.close()


def test_an_archive_whose_modules_do_not_import_is_class_import_not_incompatible() -> None:
    from pt2flow.stages.compat import check_artifact
    from tests.pytree_models import point_output

    data = _archive(point_output(), torch.ones(2))
    out = io.BytesIO()  # the archive, its metadata naming a module that is not here
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            content = src.read(info.filename)
            if info.filename.endswith("/extra/pt2flow.json"):
                assert json.loads(content)["pytree_modules"] == ["tests.pytree_models"]
                content = json.dumps({"pytree_modules": ["tests.no_such_mod"]}).encode()
            dst.writestr(info, content)
    broken = out.getvalue()
    result = check_artifact("archive", broken, None, 1e-5, 1e-4)
    assert (result["loads"], result["error_class"]) == (None, "import")
    assert "importing 'tests.no_such_mod'" in result["error"]


def test_a_package_gets_its_archives_modules_imported_first_and_one_missing_is_class_import() -> None:
    """An AOTInductor package records no pytree modules itself: check-compat imports those its
    model's archive names before loading it, as a serving process must; one that does not import
    here is `import` (the model's library is missing), never `incompatible`. The modules are
    imported before the package is even opened, so no compile is needed to see it."""
    from pt2flow.flows.engine.maintenance.compat import _pytree_modules
    from pt2flow.stages.compat import check_artifact
    from tests.pytree_models import point_output

    archive = _archive(point_output(), torch.ones(2))
    assert _pytree_modules({}, archive) == ["tests.pytree_models"]  # read from the zip, no torch needed
    assert _pytree_modules({"aot_compile": {"details": {"pytree_modules": ["a.b"]}}}, None) == [
        "a.b"
    ]  # no archive: the package's record
    assert _pytree_modules({}, _archive(models.tiny_mlp().eval(), torch.randn(2, 8))) is None
    result = check_artifact("compiled", b"not opened", None, 1e-5, 1e-4, modules=["tests.no_such_mod"])
    assert (result["loads"], result["error_class"]) == (None, "import") and "importing 'tests.no_such_mod'" in result[
        "error"
    ]
    result = check_artifact("compiled", b"not a package", None, 1e-5, 1e-4, modules=["tests.pytree_models"])
    assert result["error_class"] == "incompatible" and result["error"].startswith(
        "compiled does not load with this torch"
    )
