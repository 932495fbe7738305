"""The Node runtimes of an artifact folder: onnxruntime-web (its WASM backend, in Node) and onnxruntime-node behind
OrtRunner's interface, and greedy generation in transformers.js, each through one Node process running
node_bridge.mjs (beside this file), which answers every call of the runner it serves.

The npm packages are installed apart from the Python package, at the versions NODE_PACKAGES pins, into
packages_folder() (EXPORT_ONNX_NPM, else ~/.cache/export-onnx/npm) by install_node_packages(), which
`export-onnx install-node` runs. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import shutil
import struct
import subprocess
import threading
import weakref
from pathlib import Path

import numpy as np

from exporter.artifact.folder import Artifact, open_artifact
from exporter.artifact.manifest import Manifest
from exporter.errors import ConsumerError, GraphRunError, InputError, ProviderError, first_line
from exporter.runtime.protocol import RuntimeLabel
from exporter.runtime.registry import Runtime, register_runtime
from exporter.runtime.steps import NumpySteps

log = logging.getLogger(__name__)

WEB, NODE = "onnxruntime-web", "onnxruntime-node"
TARGETS = {WEB: "wasm", NODE: "cpu"}  # where each computes: WebAssembly, the CPU through the native addon
TRANSFORMERS_JS = "@huggingface/transformers"
# The versions installed and run. transformers.js brings its own onnxruntime-node and -web at the versions it pins;
# NodeRunner runs the releases a user of onnxruntime-web or onnxruntime-node installs.
NODE_PACKAGES = {WEB: "1.31.1", NODE: "1.31.1", TRANSFORMERS_JS: "4.3.2"}
PACKAGES_ENV = "EXPORT_ONNX_NPM"
# transformers.js loads sharp, which takes Node 20.9 or newer.
NODE_MAJOR = 20
INSTALL_HINT = (
    f"install Node.js {NODE_MAJOR} or newer with npm (Debian: apt-get install nodejs npm), then run "
    "export-onnx install-node"
)
BRIDGE = Path(__file__).with_name("node_bridge.mjs")
# onnxruntime-node's install script downloads the CUDA provider's libraries from outside the npm registry; the CPU
# build it runs on here ships in the package. Scripts are skipped altogether: none of the packages needs one to run.
_NPM_INSTALL = ("install", "--no-audit", "--no-fund", "--ignore-scripts", "--omit=dev")


def packages_folder() -> Path:
    """Where the npm packages live: $EXPORT_ONNX_NPM, else ~/.cache/export-onnx/npm."""
    given = os.environ.get(PACKAGES_ENV)
    return Path(given) if given else Path.home() / ".cache" / "export-onnx" / "npm"


def _installed_version(folder: Path, package: str) -> str | None:
    try:
        return json.loads((folder / "node_modules" / package / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


@functools.cache
def _node_version(node: str) -> str:
    done = subprocess.run([node, "--version"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def node_unavailable(folder: Path | None = None, packages=tuple(NODE_PACKAGES)) -> str:
    """Why the Node runtimes cannot run here, in one line naming the fix; "" when node (NODE_MAJOR or newer) and
    `packages` (installed at NODE_PACKAGES' versions in `folder`, default packages_folder()) are there."""
    node = shutil.which("node")
    if node is None:
        return f"node is not installed; {INSTALL_HINT}"
    version = _node_version(node)
    major = version.removeprefix("v").partition(".")[0]
    if not major.isdigit() or int(major) < NODE_MAJOR:
        return f"{node} is Node.js {version or 'of an unknown version'}; {INSTALL_HINT}"
    return next(filter(None, (package_unavailable(package, folder) for package in packages)), "")


def package_unavailable(package: str, folder: Path | None = None) -> str:
    """Why the npm package `package` is not there to run, in one line naming the fix; "" when it is installed at
    NODE_PACKAGES' version in `folder` (default packages_folder())."""
    folder = packages_folder() if folder is None else Path(folder)
    found = _installed_version(folder, package)
    if found == NODE_PACKAGES[package]:
        return ""
    what = "is not installed" if found is None else f"is at {found}, not {NODE_PACKAGES[package]}"
    return f"the npm package {package} {what} in {folder}; {INSTALL_HINT}"


def install_node_packages(folder: Path | None = None) -> Path:
    """npm-install NODE_PACKAGES into `folder` (default packages_folder()) unless they are there at those versions;
    return the folder.

    Raises:
        ProviderError: npm is missing, or the install failed (npm's last error line quoted).
    """
    folder = packages_folder() if folder is None else Path(folder)
    if all(_installed_version(folder, name) == version for name, version in NODE_PACKAGES.items()):
        return folder
    npm = shutil.which("npm")
    if npm is None:
        raise ProviderError(f"npm is not installed; {INSTALL_HINT}")
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"name": "export-onnx-node-runtimes", "private": True, "dependencies": NODE_PACKAGES}
    (folder / "package.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log.info("installing %s into %s with npm", ", ".join(f"{n}@{v}" for n, v in NODE_PACKAGES.items()), folder)
    done = subprocess.run(
        [npm, *_NPM_INSTALL, "--prefix", str(folder)],
        capture_output=True,
        text=True,
        env={**os.environ, "ONNXRUNTIME_NODE_INSTALL": "skip"},
    )
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if line.strip()] or ["no output"]
        raise ProviderError(f"npm could not install {', '.join(NODE_PACKAGES)} into {folder}: {errors[-1]}")
    return folder


class NodeError(Exception):
    """The bridge's one-line answer to a request that failed; its callers say what failed."""


def encode_frame(header: dict, arrays: dict[str, np.ndarray] | None = None) -> list:
    """One request to a bridge (node_bridge.mjs, or the Chromium page): its length and JSON header, then the bytes of
    each array (uncopied), as the pieces to send in order."""
    arrays = {name: np.ascontiguousarray(value) for name, value in (arrays or {}).items()}
    specs = [{"name": n, "dtype": v.dtype.name, "shape": list(v.shape)} for n, v in arrays.items()]
    body = json.dumps({**header, "tensors": specs}).encode()
    return [struct.pack("<I", len(body)) + body, *(value.reshape(-1).view(np.uint8) for value in arrays.values())]


def read_frame(read) -> tuple[dict, dict[str, np.ndarray]]:
    """One reply of a bridge, read by `read(size)` (which returns exactly `size` bytes or raises): its header and its
    arrays, writable as onnxruntime's Python API returns them."""
    reply = json.loads(read(struct.unpack("<I", read(4))[0]))
    tensors = [(spec, read(_nbytes(spec))) for spec in reply.pop("tensors")]
    return reply, {
        spec["name"]: np.frombuffer(bytearray(data), spec["dtype"]).reshape(spec["shape"]) for spec, data in tensors
    }


class NodeBridge:
    """One Node process running node_bridge.mjs: requests of a JSON header and numpy arrays, answered in order.

    The process ends with close(), or when the bridge is garbage collected.

    Args:
        folder: the npm packages' folder (packages_folder()).
        packages: the packages the caller needs, checked before the process starts.

    Raises:
        ProviderError: node or a package is missing (node_unavailable's reason).
    """

    def __init__(self, folder: Path | None = None, packages=tuple(NODE_PACKAGES)):
        folder = packages_folder() if folder is None else Path(folder)
        if reason := node_unavailable(folder, packages):
            raise ProviderError(reason)
        self._process = subprocess.Popen(
            ["node", str(BRIDGE), str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self._stderr = collections.deque(maxlen=20)  # what Node said last, for the message when it dies
        self._drain = threading.Thread(target=keep_lines, args=(self._process.stderr, self._stderr), daemon=True)
        self._drain.start()
        self._close = weakref.finalize(self, _end, self._process)
        self._turn = threading.Lock()  # one request and its reply at a time: threads sharing a runner take turns

    def request(self, header: dict, arrays: dict[str, np.ndarray] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
        """Send one request; return the reply's header and arrays.

        Raises:
            NodeError: the bridge answered with an error, or Node ended (its last stderr line quoted).
        """
        if not self._close.alive:
            raise NodeError("the Node process was closed")
        pieces = encode_frame(header, arrays)
        with self._turn:
            try:
                for piece in pieces:
                    self._process.stdin.write(piece)
                self._process.stdin.flush()
                reply, tensors = read_frame(self._read)
            except (BrokenPipeError, EOFError):
                self._drain.join(timeout=5)  # everything Node said before it ended
                said = next((line for line in reversed(self._stderr) if line.strip()), "no output")
                raise NodeError(f"node ended (exit code {self._process.wait(timeout=5)}): {said}") from None
        if "error" in reply:
            raise NodeError(reply["error"])
        return reply, tensors

    def _read(self, size: int) -> bytes:
        data = self._process.stdout.read(size)
        if len(data) < size:
            raise EOFError
        return data

    def close(self) -> None:
        self._close()


def _nbytes(spec: dict) -> int:
    return int(np.prod(spec["shape"], dtype=np.int64)) * np.dtype(spec["dtype"]).itemsize


def keep_lines(stream, lines: collections.deque) -> None:
    """Read a process's output stream to its end, keeping its last lines in `lines` (a bounded deque)."""
    for line in stream:
        lines.append(line.decode(errors="replace").rstrip())


def _end(process: subprocess.Popen) -> None:
    try:
        process.stdin.close()  # the bridge ends at the end of its input
    except OSError:  # it has ended already
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class NodeRunner(NumpySteps):
    """Both graphs of an artifact folder in onnxruntime-web (WASM) or onnxruntime-node, behind OrtRunner's
    interface: prefill/decode on named numpy feeds, and NumpySteps' empty_past and start/step for generation (both
    run decode.onnx, the prompt on an empty past, as OrtRunner's do).

    Args:
        artifact: an opened Artifact, or an artifact folder's path.
        runtime: "onnxruntime-web" or "onnxruntime-node".
        threads: the runtime's intra-op threads; onnxruntime-web's WASM threads run as Node workers.
        packages: the npm packages' folder; None: packages_folder().
        check_hashes: check every file's sha256 when `artifact` is a path.

    Raises:
        ProviderError: node or the runtime's package is missing, or the runtime cannot load the graphs.
    """

    def __init__(
        self,
        artifact: Artifact | Path,
        runtime: str = WEB,
        threads: int = 1,
        packages: Path | None = None,
        check_hashes: bool = True,
    ):
        if runtime not in (WEB, NODE):
            raise InputError(f"runtime must be {WEB!r} or {NODE!r}, got {runtime!r}")
        self.artifact = open_artifact(artifact, check_hashes=check_hashes)
        self.folder, self.manifest = self.artifact.folder, self.artifact.manifest
        name = self.registered or runtime
        self.provider = f"{name} {TARGETS[runtime]}"  # the row's name in the reports
        self.capabilities = frozenset()
        self.cache = None
        # Milliseconds the last prefill/decode call spent in the runtime's session.run inside Node: the call without
        # the feeds' and outputs' way through the pipe, as a program in Node that keeps its tensors would see it.
        self.last_run_ms: float | None = None
        self._bridge = self._open_bridge(packages, runtime)
        graphs = [self.manifest.prefill.file, self.manifest.decode.file]
        weights = self.manifest.weights_file if self.manifest.weights_file in self.manifest.files else None
        folder = str(self.folder.resolve())
        load = {"op": "load", "runtime": runtime, "folder": folder, "graphs": graphs, "weights": weights}
        try:
            self._bridge.request({**load, "threads": threads})
        except NodeError as exc:
            self._bridge.close()
            raise ProviderError(f"{runtime} could not load {self.folder}: {first_line(exc, 400)}") from None
        self.version = NODE_PACKAGES[runtime]  # node_unavailable found it installed at this version
        self.runtime = RuntimeLabel(
            f"{name} {self.version}",
            f"{TARGETS[runtime]} in {self._host()}, {threads} thread(s)",
            notes=_accuracy_level_notes(self.manifest) if runtime == WEB else (),
        )
        self.lock = threading.RLock()  # generation's turns, as on OrtRunner

    registered = ""  # the registered runtime's name (exporter.runtime.registry), where it is not the npm package's

    def _open_bridge(self, packages: Path | None, runtime: str):
        """The bridge that answers the runner's requests (NodeBridge's interface)."""
        return NodeBridge(packages, (runtime,))

    def _host(self) -> str:
        """Where the runtime runs, in words, for the rows' configuration."""
        return "Node.js"

    @property
    def name(self) -> str:
        return self.runtime.name

    def close(self) -> None:
        """End the Node process; the runner cannot run afterwards."""
        self._bridge.close()

    def __enter__(self) -> NodeRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, contract, feeds: dict) -> dict:
        header = {"op": "run", "graph": contract.file, "outputs": contract.output_names}
        try:
            reply, outputs = self._bridge.request(header, feeds)
        except NodeError as exc:
            raise GraphRunError(contract.file, f"{self.provider}: {first_line(exc, 400)}") from None
        self.last_run_ms = reply["ms"]
        return outputs

    def prefill(self, feeds: dict) -> dict:
        return self._run(self.manifest.prefill, feeds)

    def decode(self, feeds: dict) -> dict:
        return self._run(self.manifest.decode, feeds)


def transformers_js_greedy(
    artifact: Artifact, prompt: list[int], max_new_tokens: int, packages: Path | None = None
) -> list[int]:
    """transformers.js's greedy generation (AutoModelForCausalLM.generate, do_sample false, on onnxruntime-node as
    in Node by default) from `prompt` on the folder as it is; the new ids, up to and including its EOS.

    It loads decode.onnx alone, as its one-graph model: from_pretrained(folder, {subfolder: "", model_file_name:
    "decode", dtype: "fp32"}); its dtype names the file's suffix (fp32: none), and the cache takes the dtype the graph
    declares. Local files only: a missing file is an error, never a download.

    Raises:
        ConsumerError: node or transformers.js is missing, or it could not load or run the folder.
    """
    if reason := node_unavailable(packages, (TRANSFORMERS_JS,)):
        raise ConsumerError(reason)
    bridge = NodeBridge(packages, (TRANSFORMERS_JS,))
    request = {
        "op": "generate",
        "folder": str(artifact.folder.resolve()),
        "model_file": Path(artifact.manifest.decode.file).stem,
        "dtype": "fp32",
        "prompt": [int(i) for i in prompt],
        "max_new_tokens": int(max_new_tokens),
    }
    try:
        reply, _ = bridge.request(request)
    except NodeError as exc:
        raise ConsumerError(f"transformers.js could not run {artifact.folder}: {first_line(exc, 400)}") from None
    finally:
        bridge.close()
    return reply["ids"][len(prompt) :]


def _accuracy_level_notes(manifest: Manifest) -> tuple[str, ...]:
    """What onnxruntime-web's rows of a quantized artifact say of the accuracy_level its WASM kernels ignore."""
    quantization = manifest.quantization
    levels = [] if quantization is None else sorted(quantization.levels - {0, 1})
    if not levels:
        return ()
    return (
        f"onnxruntime-web's WASM MatMulNBits ignores this artifact's accuracy_level {', '.join(map(str, levels))}: "
        "it computes with float activations as at level 0, where ONNX Runtime's CPU provider computes at the "
        "artifact's level (int8 activations at level 4), so its answers differ from ONNX Runtime's by that",
    )


def _registered(runtime: str) -> Runtime:
    """The runtime `runtime` in the registry: one target, its Node runner, installed when node_unavailable says so."""

    def version() -> str | None:
        return None if node_unavailable(packages=(runtime,)) else NODE_PACKAGES[runtime]

    def targets(manifest: Manifest, providers: list[str] | None) -> tuple[list[str], dict[str, str]]:
        return [TARGETS[runtime]], {}

    def runner(artifact: Artifact, target: str, weights=None, threads: int | None = None) -> NodeRunner:
        counted = {} if threads is None else {"threads": threads}
        return NodeRunner(artifact, runtime, **counted)  # Node reads the weights file itself

    return Runtime(name=runtime, install=INSTALL_HINT, version=version, targets=targets, runner=runner)


for _runtime in (WEB, NODE):
    register_runtime(_registered(_runtime))
