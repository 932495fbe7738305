"""reference/source.py and verify/references/model_source.py: where an artifact's weights came from, and rebuilding
its reference from that record."""

import pytest
import torch

from reference import build_model, get_preset
from reference.checkpoint_files import fingerprint


def test_the_reference_is_rebuilt_from_the_recorded_source_only_while_it_is_what_was_exported(tmp_path, monkeypatch):
    """model_source without an export: a manifest is read here only for its source and config."""
    from types import SimpleNamespace

    from exporter.errors import ArtifactError
    from exporter.verify.references.model_source import Reference, rebuild_reference, reference_for
    from reference.source import checkpoint_model, seeded_model

    config = get_preset("minimind-3-tiny")
    monkeypatch.chdir(tmp_path)
    weights = build_model(config, seed=6)  # the checkpoint's weights are not the recorded seed's
    expect = {"seeded": build_model(config, seed=5), "checkpoint": weights}
    torch.save(weights.state_dict(), "model.pth")
    sourced = checkpoint_model("model.pth", preset="minimind-3-tiny")  # relative: recorded resolved
    assert sourced.source["path"] == str(tmp_path / "model.pth")
    assert sourced.source["sha256"] == fingerprint(tmp_path / "model.pth")
    manifests = {
        "seeded": SimpleNamespace(source=seeded_model("MiniMind-3-Tiny", 5).source, config=config),
        "checkpoint": SimpleNamespace(source=sourced.source, config=config),
    }
    assert manifests["seeded"].source == {"kind": "seeded", "preset": "minimind-3-tiny", "seed": 5}
    for kind, manifest in manifests.items():  # the recorded seed, not the default 0; the checkpoint's weights
        assert reference_for(manifest) == reference_for(manifest, stand_in=tmp_path) == Reference("rebuilt")
        rebuilt, expected = rebuild_reference(tmp_path, manifest).state_dict(), expect[kind].state_dict()
        assert rebuilt.keys() == expected.keys() and all(torch.equal(rebuilt[k], expected[k]) for k in expected), kind
    golden = reference_for(manifests["seeded"], golden=tmp_path / "bundle")  # a bundle given wins over a rebuild
    assert golden == Reference("golden", tmp_path / "bundle") and golden.model(tmp_path, manifests["seeded"]) is None

    changed = manifests["checkpoint"]
    (tmp_path / "model.pth").write_bytes((tmp_path / "model.pth").read_bytes() + b"\0")  # changed, same path
    custom = SimpleNamespace(source={"kind": "custom"}, config=config)
    unnamed = SimpleNamespace(source={}, config=config)
    for manifest, reason in (
        (changed, f"its checkpoint {tmp_path / 'model.pth'} changed since the export"),
        (custom, "the weights came from a custom source this toolkit cannot rebuild"),
        (unnamed, "the weights came from an unnamed source this toolkit cannot rebuild"),
    ):
        none = reference_for(manifest, stand_in=tmp_path / "golden")  # no such folder: no stand-in
        assert none.kind == "none" and none.problem.reason == reason
        with pytest.raises(ArtifactError, match="golden bundle"):
            none.model(tmp_path, manifest)
        with pytest.raises(ArtifactError, match="golden bundle"):
            rebuild_reference(tmp_path, manifest)
        (tmp_path / "golden").mkdir()
        stand_in = reference_for(manifest, stand_in=tmp_path / "golden")
        assert (stand_in.kind, stand_in.bundle, stand_in.problem) == ("golden", tmp_path / "golden", none.problem)
        (tmp_path / "golden").rmdir()
    (tmp_path / "model.pth").unlink()
    assert reference_for(changed).problem.reason == f"its checkpoint {tmp_path / 'model.pth'} is gone"
