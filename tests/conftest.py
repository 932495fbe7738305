"""Shared fixtures: tiny seeded models and artifacts exported once per test session.

A dynamo export costs 15-40 s even for a tiny model, so each artifact is
built once and shared; tests that modify an artifact work on a copy.
"""

from __future__ import annotations

import shutil

import pytest

from exporter.export import export_artifact
from reference import build_model, get_preset

TINY = "minimind-3-tiny"


@pytest.fixture(scope="session")
def tiny_config():
    return get_preset(TINY)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    return build_model(tiny_config, seed=0)


def _export(tmp_path_factory, model, dtype):
    folder = tmp_path_factory.mktemp(f"artifact-{dtype}") / TINY
    export_artifact(model, folder, dtype=dtype, source={"kind": "seeded", "preset": TINY, "seed": 0})
    return folder


@pytest.fixture(scope="session")
def artifact_fp32(tmp_path_factory, tiny_model):
    return _export(tmp_path_factory, tiny_model, "float32")


@pytest.fixture(scope="session")
def artifact_fp16(tmp_path_factory, tiny_model):
    return _export(tmp_path_factory, tiny_model, "float16")


@pytest.fixture
def artifact_copy(artifact_fp32, tmp_path):
    """A private copy of the fp32 artifact that a test may damage."""
    return shutil.copytree(artifact_fp32, tmp_path / TINY)
