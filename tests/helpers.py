"""Checks several test modules share: closeness with a diagnostic message, cache equivalence, decode parity."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from filelock import FileLock
from onnx import numpy_helper

from exporter import TOLERANCES, compare
from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import file_entries, read_manifest, sha256_file
from exporter.artifact.quantization import QUANTIZED_OPS, held_inputs, smoothing_divisors, zero_point_fractions
from exporter.artifact.scopes import module_of
from exporter.errors import ProviderError
from exporter.runtime.node import install_node_packages, node_unavailable, packages_folder
from exporter.runtime.runner import OrtRunner, position_ids_from_mask, presents_as_past
from exporter.verify.inputs import ParitySettings
from exporter.verify.references.torch_runner import TorchRunner

# Prompts that consumers (onnxruntime-genai, Optimum) generate from in the token-equality tests.
CONSUMER_PROMPTS = [[1, 17, 230, 4, 99], [7], [300, 301, 302, 303, 304, 305, 306, 307]]

# A CLI verification on the CPU provider alone, without the consumer checks (onnxruntime-genai, transformers.js),
# which their own tests run: what most CLI tests of the verification pass.
CPU_ONLY = ("--provider", "cpu", "--no-genai", "--no-transformers-js")

# Verification settings that keep a verify_artifact test short: 2 decode steps, the probe on, and the long checks
# (the sweep, long positions) off, each tested on its own.
QUICK = ParitySettings(decode_steps=2, greedy_tokens=4, sweep=False, long_context=False, probe=True)


ROOT = Path(__file__).resolve().parents[1]
OPTIMUM_REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==4.57.6",
    "optimum-onnx==0.1.0",
    f"onnxruntime=={onnxruntime.__version__}",
)


def shared_folder(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """A folder that `build(folder)` fills once per test run (`folder` exists and is empty when it is called).

    Alone, a fresh temporary folder. Under pytest-xdist, every worker of the run gets the same one, under the run's
    base temporary folder: the first worker to ask builds it while a file lock holds the others, who then read it.
    A build that raises leaves no mark, so the next worker to ask builds it again (and meets the same error).
    Callers must not modify the folder (copy it first), as with any session-scoped fixture.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    root = tmp_path_factory.getbasetemp().parent / "shared"
    root.mkdir(exist_ok=True)
    folder, built = root / name, root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        if not built.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            built.touch()
    return folder


def _optimum_venv() -> Path:
    """Where Optimum's environment is kept between runs and checkouts: the user's cache, one environment per set of
    requirements, interpreter and suite site-packages it reads (its .pth names that folder)."""
    key = repr((OPTIMUM_REQUIREMENTS, sys.version, sysconfig.get_paths()["purelib"]))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "export-onnx"
    return cache / f"venv-optimum-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def optimum_python() -> Path:
    """Optimum's interpreter, its environment built when missing; skips (with pip's reason) where it cannot be.

    A file lock beside the environment makes test processes running at once (pytest-xdist) build it once."""
    given = os.environ.get("EXPORT_ONNX_OPTIMUM_PYTHON")
    python = Path(given) if given else _optimum_venv() / "bin" / "python"
    if not given:
        with FileLock(str(python.parents[1]) + ".lock"):
            _build_optimum_venv(python)
    probe = subprocess.run([str(python), "-c", "import optimum.onnxruntime"], capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"optimum.onnxruntime does not import in {python} ({last})")
    return python


def node_packages() -> Path:
    """The npm packages of the Node runtimes (exporter.runtime.node), installed when missing into their folder
    (EXPORT_ONNX_NPM, else ~/.cache/export-onnx/npm), which keeps them for later runs; skips with the one-line
    reason where node is missing or too old, or npm cannot install them. A file lock beside the folder makes test
    processes running at once (pytest-xdist) install them once."""
    folder = packages_folder()
    if reason := node_unavailable(folder, packages=()):  # node itself: missing, or older than the packages take
        pytest.skip(reason)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        try:
            return install_node_packages(folder)
        except ProviderError as exc:
            pytest.skip(str(exc))


def _build_optimum_venv(python: Path) -> None:
    """The environment: Optimum and the transformers it needs installed in it, which come first on its path; PyTorch
    and onnxruntime (OPTIMUM_REQUIREMENTS pins the versions this suite's environment has) read from this suite's
    site-packages, listed after its own by a .pth file, instead of a second copy of PyTorch installed."""
    if python.exists():
        return
    venv = python.parents[1]
    own_site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    steps = (
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        # this interpreter's pip installs into the new one (--python), which sees this suite's packages through the
        # .pth and installs only what they lack or hold at another version
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *OPTIMUM_REQUIREMENTS],
    )
    for index, step in enumerate(steps):
        done = subprocess.run(step, capture_output=True, text=True, timeout=1200)
        if done.returncode:
            shutil.rmtree(venv, ignore_errors=True)  # half built: the next run starts again
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"Optimum's environment could not be built ({' '.join(step[:4])}...: {last})")
        if index == 0:
            (own_site / "suite-site-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


def run_cli(*args):
    """export-onnx in this process (click's test runner), every argument as a string."""
    from click.testing import CliRunner

    from exporter.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, code: int, fragment: str) -> None:
    """The command failed with `code` and said why in one line on stderr, `fragment` in it, no traceback."""
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.output


def swapped_in_first(function, folder: Path):
    """`function`, before whose first call an export lands in `folder` as export._move_into_place lands one: a new
    folder (here a copy of the artifact, the same files) renamed into its place, the earlier one moved aside."""
    calls = []

    def swap_then_call(*args, **kwargs):
        if not calls:
            calls.append(folder)
            new = shutil.copytree(folder, folder.with_name(folder.name + ".new"))
            os.rename(folder, folder.with_name(folder.name + ".old"))
            os.rename(new, folder)
        return function(*args, **kwargs)

    return swap_then_call


def edit_manifest(folder: Path, change) -> None:
    """Apply `change` (a function that edits the dict in place) to an artifact's manifest.json."""
    path = Path(folder) / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def relist_json(folder: Path, name: str, change) -> None:
    """Apply `change` (a function that edits the dict in place) to the JSON document `name` in an artifact `folder`,
    and list its new hash and size in the manifest: an edit the file check lets through."""
    path = Path(folder) / name
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))
    edit_manifest(folder, lambda m: m["files"][name].update(sha256=sha256_file(path), bytes=path.stat().st_size))


def edit_json(path: Path, **changes) -> None:
    """Replace fields of the JSON object in the file at `path` (a model folder's config.json, say)."""
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def claim_seed(seed: int):
    """A manifest edit: the reference is rebuilt with another seed's weights (the hashes still match the files)."""
    return lambda manifest: manifest["model"]["source"].update(seed=seed)


def perturb_weight(folder: Path, module: str, delta: float) -> str:
    """Add `delta` to the weight read by the MatMul (float32) or Gemm (float16) of `module` (prefill and
    decode share it), keeping the manifest's hashes consistent; returns the initializer's name."""
    manifest = read_manifest(folder)
    graph = onnx.load(str(folder / "prefill.onnx"), load_external_data=False).graph
    node = next(n for n in graph.node if n.op_type in ("MatMul", "Gemm") and module_of(n) == module)
    name = node.input[1]
    entry = next(e for e in manifest.initializers["prefill.onnx"] if e["name"] == name)
    weights = np.memmap(
        folder / manifest.weights_file,
        dtype=entry["dtype"],
        mode="r+",
        offset=entry["offset"],
        shape=tuple(entry["shape"]),
    )
    weights += delta
    weights.flush()
    digest = sha256_file(folder / manifest.weights_file)
    edit_manifest(folder, lambda data: data["files"][manifest.weights_file].update(sha256=digest))
    return name


def scale_inline_weight(folder: Path, graph_file: str, suffix: str, factor: float) -> str:
    """Multiply the initializer whose name ends with `suffix`, held inside `graph_file` (a small weight, such as
    a norm's, that each graph carries itself), by `factor` in that graph alone, keeping the manifest's hashes
    consistent; returns the initializer's name."""
    path = Path(folder) / graph_file
    model = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name.endswith(suffix))
    assert tensor.data_location != onnx.TensorProto.EXTERNAL, tensor.name
    weight = numpy_helper.to_array(tensor)
    tensor.CopyFrom(numpy_helper.from_array((weight * factor).astype(weight.dtype), tensor.name))
    onnx.save(model, str(path))
    digest = sha256_file(path)
    edit_manifest(folder, lambda data: data["files"][graph_file].update(sha256=digest))
    return tensor.name


def graph_weight(model: onnx.ModelProto, module: str) -> onnx.TensorProto:
    """The one floating initializer of more than one element that the nodes of `module` read (a Linear's matrix,
    a norm's weight, an embedding table)."""
    floating = {
        t.name: t
        for t in model.graph.initializer
        if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) and np.prod(t.dims) > 1
    }
    [name] = {i for node in model.graph.node if module_of(node) == module for i in node.input if i in floating}
    return floating[name]


def _graph_files(folder: Path) -> list[str]:
    manifest = read_manifest(folder, check_hashes=False)
    return [manifest.prefill.file, manifest.decode.file]


def read_weight(folder: Path, module: str) -> np.ndarray:
    """The values of the weight that the nodes of `module` read, as prefill.onnx holds it (inline or in the
    weights file)."""
    model = onnx.load(str(Path(folder) / _graph_files(folder)[0]), load_external_data=False)
    return read_initializer(folder, graph_weight(model, module).name)


def edit_initializers(folder: Path, pick) -> None:
    """Replace initializers of both graphs: `pick(model)` gives, for a graph, {initializer name: change(values) ->
    values}; each in the weights file where it lies there (once: both graphs read the same bytes), else inline in
    each graph; then re-sign the manifest (sizes and sha256 of the files changed)."""
    folder = Path(folder)
    manifest = read_manifest(folder, check_hashes=False)
    changed, written = set(), set()
    for file in _graph_files(folder):
        model = onnx.load(str(folder / file), load_external_data=False)
        initializers = {t.name: t for t in model.graph.initializer}
        for name, change in pick(model).items():
            tensor = initializers[name]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                offset = int(next(e.value for e in tensor.external_data if e.key == "offset"))
                if offset in written:
                    continue
                values = np.memmap(
                    folder / manifest.weights_file, dtype=dtype, mode="r+", offset=offset, shape=tuple(tensor.dims)
                )
                values[...] = change(np.array(values))
                values.flush()
                written.add(offset)
                changed.add(manifest.weights_file)
            else:
                values = numpy_helper.to_array(tensor)
                tensor.CopyFrom(numpy_helper.from_array(change(values.copy()).astype(dtype), tensor.name))
                changed.add(file)
        if file in changed:
            onnx.save(model, str(folder / file))
    edit_manifest(folder, lambda data: data["files"].update(file_entries(folder, sorted(changed))))


def edit_weights(folder: Path, changes: dict) -> None:
    """Replace the weight that the nodes of each module (a key of `changes`) read by `change(values)`, in both
    graphs (edit_initializers)."""
    edit_initializers(folder, lambda model: {graph_weight(model, m).name: c for m, c in changes.items()})


def quantized_blocks(model: onnx.ModelProto, module: str) -> list[str]:
    """The initializers (blocks, scales, zero points; then, for an HQQ node, its zero points' fractions and the
    block-sum matrix; for a smoothed one, its input's divisors) of the quantized node that lies in `module`."""
    [node] = [n for n in model.graph.node if n.op_type in QUANTIZED_OPS and module_of(n) == module]
    return held_inputs(node, zero_point_fractions(model.graph), smoothing_divisors(model.graph))


def read_initializer(folder: Path, name: str) -> np.ndarray:
    """An initializer's values as prefill.onnx holds it (inline or in the weights file)."""
    model = onnx.load(str(Path(folder) / _graph_files(folder)[0]), load_external_data=False)
    [tensor] = [t for t in model.graph.initializer if t.name == name]
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        onnx.external_data_helper.load_external_data_for_tensor(tensor, str(folder))
    return numpy_helper.to_array(tensor)


def largest(values: np.ndarray) -> tuple:
    """The index of the element of largest magnitude: one that any relative change moves, float16 included."""
    return np.unravel_index(int(np.argmax(np.abs(values))), values.shape)


def scaled(index, factor: float):
    """An edit_weights change: the element (or slice) at `index` times `factor`; None: the largest element."""

    def change(values):
        values[index if index is not None else largest(values)] *= factor
        return values

    return change


def swapped(folder: Path, a: str, b: str) -> dict:
    """edit_weights changes that exchange the weights the nodes of modules `a` and `b` read."""
    first, second = read_weight(folder, a), read_weight(folder, b)
    return {a: lambda _: second, b: lambda _: first}


def edit_graphs(folder: Path, change) -> None:
    """Apply `change` (a function that edits an onnx.GraphProto in place) to both graphs, without their weights,
    and re-sign the manifest."""
    folder = Path(folder)
    files = _graph_files(folder)
    for file in files:
        model = onnx.load(str(folder / file), load_external_data=False)
        change(model.graph)
        onnx.save(model, str(folder / file))
    edit_manifest(folder, lambda data: data["files"].update(file_entries(folder, files)))


def random_ids(vocab: int, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def padded_batch_logits(model, vocab: int, pad: int):
    """A batch of a 6-token row left-padded by `pad` and a 10-token row. Returns its logits with positions that
    skip the padding (as the ONNX contract feeds them), its logits with the model's default positions, and
    the logits of each row's sequence alone."""
    short, full = random_ids(vocab, 1, 6, seed=1), random_ids(vocab, 1, 10, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), full])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return (
        model(batch, attention_mask=mask, position_ids=positions).logits,
        model(batch, attention_mask=mask).logits,
        model(short).logits[0],
        model(full).logits[0],
    )


def assert_close(actual, expected, atol, rtol=0.0):
    diff = (actual.double() - expected.double()).abs()
    assert torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol), (
        f"max abs diff {diff.max().item():.3g}, mean {diff.mean().item():.3g}"
    )


@torch.no_grad()
def assert_cached_decoding_equals_full_forward(model, ids, kv_shape, chunkings=None):
    """Token by token and in uneven chunks through the model's own cache: logits and the final cache."""
    length = ids.shape[1]
    full = model(ids, use_cache=True)
    for chunks in chunkings or ([1] * length, [5, 1, 3, length - 9]):
        past, logits, start = None, [], 0
        for size in chunks:
            out = model(ids[:, start : start + size], past_key_values=past, use_cache=True)
            past, start = out.past_key_values, start + size
            logits.append(out.logits)
        assert_close(torch.cat(logits, 1), full.logits, atol=1e-5)
        for (k, v), (fk, fv) in zip(past, full.past_key_values):
            assert k.shape == kv_shape
            assert_close(k, fk, atol=1e-5)
            assert_close(v, fv, atol=1e-5)


def assert_decode_graph_matches(artifact, model, batch: int, length: int, past: int) -> None:
    """The decode graph on a real, ragged cache (built by a reference prefill) at the given sizes."""
    manifest = read_manifest(artifact, check_hashes=False)
    onnx, reference = OrtRunner(Artifact(artifact, manifest)), TorchRunner(model, manifest)
    rng = np.random.default_rng(batch * 100 + length * 10 + past)
    vocab = manifest.config.vocab_size
    mask = np.ones((batch, past + length), dtype=np.int64)
    mask[1:, : past // 2] = 0
    feeds = onnx.empty_past(batch)
    if past:
        prompt = rng.integers(0, vocab, (batch, past), dtype=np.int64)
        feeds = presents_as_past(
            manifest,
            reference.prefill(
                {
                    "input_ids": prompt,
                    "attention_mask": mask[:, :past],
                    "position_ids": position_ids_from_mask(mask[:, :past]),
                }
            ),
        )
    feeds.update(
        input_ids=rng.integers(0, vocab, (batch, length), dtype=np.int64),
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask, past),
    )
    expected, actual = reference.decode(feeds), onnx.decode(feeds)
    for name, value in expected.items():
        assert actual[name].shape == value.shape, name
        kind = "logits" if name == "logits" else "kv"
        result = compare(name, kind, actual[name], value, TOLERANCES["float32"][kind])
        assert result.passed, result.to_dict()


def replayed_export(monkeypatch, float_artifact):
    """export_artifact's torch.onnx step replaced by a float artifact's own graphs (benchmarks/quality.py's
    float_graphs; float32, or float16 for float16 activations): quantized exports of the tiny model go through
    everything else: quantization, the shared weights file, the checks and the smoke run."""
    import exporter.export.tracing as tracing

    monkeypatch.setattr(tracing, "traced_graphs", benchmark_script("quality").float_graphs(float_artifact))


@functools.cache
def benchmark_script(name: str):
    """benchmarks/<name>.py imported as a module (benchmark_<name>), once."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config_entry(session, key: str) -> str | None:
    """A session's configuration entry, None where it has none."""
    try:
        return session.get_session_options().get_session_config_entry(key)
    except RuntimeError:  # onnxruntime: "SessionOptions does not have configuration with key"
        return None
