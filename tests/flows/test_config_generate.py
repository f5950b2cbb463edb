"""`generate:` in a config (issue 34): checked at its YAML path, part of the source key, no inputs needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pt2flow.flows.config import ConfigError, load_config
from pt2flow.flows.engine.common.source_manifest import source_manifest

FACTORY = "def tiny():\n    raise RuntimeError('never built here')\n"


def _write(folder: Path, model: dict) -> Path:
    (folder / "gen_models.py").write_text(FACTORY)
    path = folder / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "stages": ["trace", "serialize", "validate"],
                "models": [{"name": "lm", "factory": "gen_models:tiny", **model}],
            },
            sort_keys=False,
        )
    )
    return path


def test_a_generative_model_needs_no_inputs_and_its_generate_is_in_the_source_key(tmp_path: Path) -> None:
    config = load_config(
        _write(
            tmp_path,
            {"generate": {"prompt_lens": [2, 16], "max_new_tokens": 8, "cache": "static", "max_cache_len": 32}},
        )
    )
    (model,) = config.models
    assert model.generate is not None and model.generate.prompt_lens == [2, 16] and model.component is None
    manifest, _ = source_manifest(model, None)
    assert manifest["generate"]["max_cache_len"] == 32
    scoped = model.of_component("decode")
    assert (scoped.name, scoped.component, scoped.parent) == ("lm/decode", "decode", "lm")


@pytest.mark.parametrize(
    ("generate", "extra", "expected"),
    [
        (
            {"max_new_tokens": 32, "cache": "static", "max_cache_len": 16},
            {},
            "models[0].generate.max_cache_len: 16 cannot hold",
        ),
        ({"cache": "paged"}, {}, "models[0].generate.cache"),
        ({"prompt_lens": [0]}, {}, "models[0].generate.prompt_lens"),
        ({"beams": 2}, {}, "models[0].generate.beams: unknown key"),
        (
            {},
            {"inputs": {"input_ids": {"shape": [1, 4], "dtype": "int64"}}},
            "models[0].inputs: a model with generate:",
        ),
    ],
)
def test_a_bad_generate_is_reported_at_its_path(tmp_path: Path, generate: dict, extra: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, {"generate": generate, **extra}))
    assert expected in str(info.value)
