"""onnxruntime-web's WASM backend in headless Chromium, as a browser runs it, behind OrtRunner's interface: the runtime
onnxruntime-web-chromium.

A local HTTP server (127.0.0.1, a free port) serves chromium_page.mjs (beside this file), the artifact's graphs and
weights, and onnxruntime-web's dist/ from the npm packages that `export-onnx install-node` installs
(exporter.runtime.node). Headless Chromium opens the page, which fetches the graphs and their external weights by
URL, as a web page does, and asks the server for each request, answering it with the frames node_bridge.mjs
answers (ort_tensors.mjs); NodeRunner's checks and rows apply unchanged. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import functools
import io
import logging
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import Manifest
from exporter.errors import ProviderError
from exporter.runtime.node import (
    NODE_PACKAGES,
    TARGETS,
    WEB,
    NodeError,
    NodeRunner,
    encode_frame,
    keep_lines,
    package_unavailable,
    packages_folder,
    read_frame,
)
from exporter.runtime.registry import Runtime, register_runtime

log = logging.getLogger(__name__)

CHROMIUM = "onnxruntime-web-chromium"
CHROMIUM_ENV = "EXPORT_ONNX_CHROMIUM"  # the browser's path, where it is not chromium on the PATH
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL_HINT = (
    f"install chromium (Debian: apt-get install chromium) or name a Chromium-based browser in ${CHROMIUM_ENV}, and "
    "the npm packages with export-onnx install-node"
)
PAGE_FILES = {name: Path(__file__).with_name(name) for name in ("chromium_page.mjs", "ort_tensors.mjs")}
PAGE = b'<!doctype html><meta charset="utf-8"><script type="module" src="/page/chromium_page.mjs"></script>\n'
START_SECONDS = 60  # for the page to ask for its first request: beyond it, the browser did not open it
POLL_SECONDS = 20  # a request for work is answered "none yet" after this long, so that no fetch waits unbounded
TYPES = {".mjs": "text/javascript", ".wasm": "application/wasm", ".html": "text/html"}
# Chromium's own flags: no sandbox (it needs user namespaces a container may lack), no GPU, no profile of the user's.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-background-networking",
    "--disable-dev-shm-usage",
)


def find_chromium() -> str | None:
    """The browser to run: $EXPORT_ONNX_CHROMIUM, else the first of BROWSERS on the PATH; None where neither is."""
    given = os.environ.get(CHROMIUM_ENV)
    return shutil.which(given) if given else next(filter(None, map(shutil.which, BROWSERS)), None)


@functools.cache
def chromium_version(browser: str) -> str:
    """`browser --version`'s line ("Chromium 156.0.8078.129 ..."), up to its version; "" where it does not run."""
    try:
        done = subprocess.run([browser, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    words = done.stdout.split()
    versions = [i for i, word in enumerate(words) if word[:1].isdigit()]
    return " ".join(words[: versions[0] + 1]) if done.returncode == 0 and versions else ""


def chromium_unavailable(folder: Path | None = None) -> str:
    """Why onnxruntime-web cannot run in headless Chromium here, in one line naming the fix; "" when a browser that
    runs and onnxruntime-web (installed in `folder`, default packages_folder()) are there."""
    browser = find_chromium()
    if browser is None:
        return f"no Chromium found ({', '.join(BROWSERS)} on the PATH, or ${CHROMIUM_ENV}); {INSTALL_HINT}"
    if not chromium_version(browser):
        return f"{browser} --version fails; {INSTALL_HINT}"
    return package_unavailable(WEB, folder)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a fetch left waiting ends with the process, not the other way round

    def __init__(self, files: dict[str, Path], requests: queue.Queue, replies: queue.Queue, ready: threading.Event):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files, self.requests, self.replies, self.ready = files, requests, replies, ready


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if self.path == "/":
            self._send(HTTPStatus.OK, PAGE, ".html")
        elif self.path == "/next":
            self.server.ready.set()
            try:
                frame = self.server.requests.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._send(HTTPStatus.ACCEPTED)
                return
            self._send(HTTPStatus.NO_CONTENT) if frame is None else self._send(HTTPStatus.OK, frame)
        elif self.path in self.server.files:
            path = self.server.files[self.path]
            self._headers(HTTPStatus.OK, path.stat().st_size, path.suffix)
            with path.open("rb") as file:  # streamed: the weights file may be large
                shutil.copyfileobj(file, self.wfile)
        else:
            self._send(HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        if self.path != "/reply":
            self._send(HTTPStatus.NOT_FOUND)
            return
        self.server.replies.put(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(HTTPStatus.NO_CONTENT)

    def _send(self, status: HTTPStatus, body: bytes = b"", suffix: str = "") -> None:
        self._headers(status, len(body), suffix)
        self.wfile.write(body)

    def _headers(self, status: HTTPStatus, size: int, suffix: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", TYPES.get(suffix, "application/octet-stream"))
        self.send_header("Content-Length", str(size))
        self.send_header("Cache-Control", "no-store")
        # cross-origin isolation, which onnxruntime-web's WASM threads need (SharedArrayBuffer)
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 -- the name BaseHTTPRequestHandler calls it by
        log.debug("chromium page: " + format, *args)


class ChromiumBridge:
    """Headless Chromium on a page of a local server: requests of a JSON header and numpy arrays, answered in order,
    as NodeBridge's are. The server and the browser end with close(), or when the bridge is garbage collected.

    Args:
        artifact: the artifact whose graphs and weights the server serves (the files its manifest lists).
        packages: the npm packages' folder (packages_folder()).

    Raises:
        ProviderError: no browser, or onnxruntime-web missing (chromium_unavailable's reason); the browser did not
            open the page.
    """

    def __init__(self, artifact: Artifact, packages: Path | None = None):
        packages = packages_folder() if packages is None else Path(packages)
        if reason := chromium_unavailable(packages):
            raise ProviderError(reason)
        dist = packages / "node_modules" / WEB / "dist"
        files = {f"/page/{name}": path for name, path in PAGE_FILES.items()}
        files |= {f"/artifact/{name}": artifact.folder / name for name in artifact.manifest.files}
        files |= {f"/ort/{path.name}": path for path in dist.iterdir() if path.suffix in (".mjs", ".wasm")}
        self._requests, self._replies, ready = queue.Queue(), queue.Queue(), threading.Event()
        server = _Server(files, self._requests, self._replies, ready)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        profile = tempfile.mkdtemp(prefix="export-onnx-chromium-")
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        self._process = subprocess.Popen(
            [find_chromium(), *FLAGS, f"--user-data-dir={profile}", url],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._stderr = collections.deque(maxlen=20)
        threading.Thread(target=keep_lines, args=(self._process.stderr, self._stderr), daemon=True).start()
        self._close = weakref.finalize(self, _end, self._process, server, self._requests, profile)
        self._turn = threading.Lock()
        deadline = time.monotonic() + START_SECONDS
        while not ready.wait(0.2):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise ProviderError(f"headless Chromium did not open the page of {url}: {self._said()}")

    def request(self, header: dict, arrays: dict[str, np.ndarray] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
        """Send one request; return the reply's header and arrays.

        Raises:
            NodeError: the page answered with an error, or the browser ended (its last stderr line quoted).
        """
        if not self._close.alive:
            raise NodeError("the Chromium page was closed")
        frame = b"".join(bytes(piece) for piece in encode_frame(header, arrays))
        with self._turn:
            self._requests.put(frame)
            while True:
                try:
                    body = self._replies.get(timeout=0.5)
                    break
                except queue.Empty:
                    if self._process.poll() is not None:
                        raise NodeError(f"chromium ended (exit code {self._process.returncode}): {self._said()}")
        reply, tensors = read_frame(_reader(body))
        if "error" in reply:
            raise NodeError(reply["error"])
        return reply, tensors

    def _said(self) -> str:
        return next((line for line in reversed(self._stderr) if line.strip()), "no output")

    def close(self) -> None:
        self._close()


def _reader(body: bytes):
    stream = io.BytesIO(body)

    def read(size: int) -> bytes:
        data = stream.read(size)
        if len(data) < size:
            raise NodeError(f"the page's reply ends after {len(body)} bytes, short of its frame")
        return data

    return read


def _end(process: subprocess.Popen, server: _Server, requests: queue.Queue, profile: str) -> None:
    requests.put(None)  # the page's loop ends
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    server.shutdown()
    server.server_close()
    shutil.rmtree(profile, ignore_errors=True)


class ChromiumRunner(NodeRunner):
    """Both graphs of an artifact folder in onnxruntime-web's WASM backend in headless Chromium, behind OrtRunner's
    interface, as NodeRunner runs them in Node: the rows' name is "onnxruntime-web-chromium wasm", their runtime
    "onnxruntime-web-chromium" at onnxruntime-web's version.

    Args:
        artifact: an opened Artifact, or an artifact folder's path.
        threads: WASM threads (workers of the page).
        packages: the npm packages' folder; None: packages_folder().
        check_hashes: check every file's sha256 when `artifact` is a path.

    Raises:
        ProviderError: no browser, onnxruntime-web missing, or it cannot load the graphs.
    """

    registered = CHROMIUM

    def __init__(
        self, artifact: Artifact | Path, threads: int = 1, packages: Path | None = None, check_hashes: bool = True
    ):
        super().__init__(artifact, WEB, threads, packages, check_hashes)

    def _open_bridge(self, packages: Path | None, runtime: str) -> ChromiumBridge:
        return ChromiumBridge(self.artifact, packages)

    def _host(self) -> str:
        return f"headless {chromium_version(find_chromium())}"


def _registered() -> Runtime:
    def version() -> str | None:
        return None if chromium_unavailable() else NODE_PACKAGES[WEB]

    def targets(manifest: Manifest, providers: list[str] | None) -> tuple[list[str], dict[str, str]]:
        return [TARGETS[WEB]], {}

    def runner(artifact: Artifact, target: str, weights=None, threads: int | None = None) -> ChromiumRunner:
        counted = {} if threads is None else {"threads": threads}
        return ChromiumRunner(artifact, **counted)  # the page fetches the weights file itself

    return Runtime(name=CHROMIUM, install=INSTALL_HINT, version=version, targets=targets, runner=runner)


register_runtime(_registered())
