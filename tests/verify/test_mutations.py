"""The mutation suite (issue 33): every fault of tests/mutants.py, written into a copy of a session artifact with its
manifest re-signed, fails verification (exit 1 where it runs through the command line), and the localisation and the
probe name the mutated layer; a weight fault is caught by the outputs too in float32, not by the weight audit alone.
Every case must pass: the kill rate is 100%. benchmarks/mutations.py prints the same runs as a table."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import run_cli
from mutants import ARTIFACTS, CLI_ARGS, MUTANTS, SETTINGS, judge, unmet

from exporter import verify_artifact


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_verify_catches_each_mutant_and_names_its_layer(mutant, request, tmp_path):
    artifact, model = (request.getfixturevalue(name) for name in ARTIFACTS[mutant.kind])
    folder = shutil.copytree(artifact, tmp_path / artifact.name)
    mutant.edit(folder)
    if mutant.cli:  # the reference rebuilt from the manifest's seeded source, as a user runs it
        result = run_cli("verify", folder, *CLI_ARGS, "--json", "-q")
        assert result.exit_code == 1, result.output
        document = json.loads(result.stdout)
    else:
        document = verify_artifact(folder, model, ["cpu"], SETTINGS, genai=False, transformers_js=False).to_dict()
    outcome = judge(mutant, document)
    assert not unmet(mutant, outcome), (unmet(mutant, outcome), outcome.to_dict())
