"""When transformers serves as the independent reference, and why not otherwise."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from exporter.verify.references import transformers_reference
from exporter.verify.references.transformers_reference import transformers_skip_reason
from reference.checkpoint_files import fingerprint


def _manifest(family: str, source: dict):
    return SimpleNamespace(family=family, source=source)


def test_only_an_hf_folder_unchanged_since_the_export_is_loaded(hf_folders, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    folder = shutil.copytree(hf_folders["qwen3"], tmp_path / "qwen3")
    source = {"kind": "checkpoint", "path": str(folder), "sha256": fingerprint(folder)}
    assert transformers_skip_reason(_manifest("hf-decoder", source)) == ""
    assert "not exported from a Hugging Face folder (family minimind)" in transformers_skip_reason(
        _manifest("minimind", source)
    )
    seeded = {"kind": "seeded", "preset": "x", "seed": 0}
    assert "not exported from a Hugging Face folder" in transformers_skip_reason(_manifest("hf-decoder", seeded))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_cache": False}))
    assert transformers_skip_reason(_manifest("hf-decoder", source)).endswith("changed since the export")
    monkeypatch.setattr(transformers_reference, "transformers_version", lambda: None)
    assert "transformers is not installed" in transformers_skip_reason(_manifest("hf-decoder", source))
