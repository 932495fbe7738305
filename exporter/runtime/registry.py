"""The runtimes a verification runs an artifact in: a name -> Runtime table that each runtime module fills once, at
its end (register_runtime), read by the verification engine and the CLI's --runtime.

A runtime gives one runner per target: ONNX Runtime one per execution provider, OpenVINO one per configuration (its
honest f32 settings and its defaults). Adding a runtime is one module that registers itself and one line in
RUNTIME_MODULES (docs/runtimes.md, "Adding a runtime").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from exporter.artifact.manifest import Manifest
from exporter.errors import InputError
from exporter.runtime.protocol import Runner

DEFAULT_RUNTIME = "onnxruntime"
ALL = "all"  # every registered runtime that is installed
# The modules that register the toolkit's runtimes, imported at the first lookup: a runtime's own package is imported
# only by its runners, so that a runtime not installed costs nothing and fails nothing until it is asked for.
RUNTIME_MODULES = (
    "exporter.runtime.runner",
    "exporter.runtime.openvino_runner",
    "exporter.runtime.node",
    "exporter.runtime.chromium",
)


@dataclass(frozen=True)
class Runtime:
    """A runtime the verification can run an artifact in.

    Attributes:
        name: what --runtime calls it ("onnxruntime", "openvino").
        install: the command that installs it, which a refusal names ("pip install openvino").
        version: its installed version; None where it is not installed (or does not import).
        targets: targets(manifest, providers) -> (targets, {target: why it does not run}): the runners to verify on,
            each a row of the report. `providers` are the ONNX Runtime providers asked for (None: every available
            one), which other runtimes ignore. Raises ProviderError for a target that cannot run the artifact.
        runner: runner(artifact, target, weights=None, threads=None) -> Runner, for the verification's checks.
            `weights` is the artifact's weights file mapped once (exporter.runtime.shared_weights.SharedWeightMap),
            which a runtime that reads weights in place shares; others ignore it. `threads`: the intra-op threads of
            the runner's sessions; None: the runtime's count in the verification (a comparison across runtimes
            gives each the same).
    """

    name: str
    install: str
    version: Callable[[], str | None]
    targets: Callable[[Manifest, list[str] | None], tuple[list[str], dict[str, str]]]
    runner: Callable[..., Runner]


_RUNTIMES: dict[str, Runtime] = {}


def register_runtime(runtime: Runtime) -> None:
    """Add `runtime` to the table, once: a second runtime of its name would replace the first unseen."""
    if runtime.name in _RUNTIMES or runtime.name == ALL:
        raise InputError(f"a runtime named {runtime.name!r} is registered already; give the new one its own name")
    _RUNTIMES[runtime.name] = runtime


def registered_runtimes() -> dict[str, Runtime]:
    """Every registered runtime by name, the toolkit's own first."""
    for module in RUNTIME_MODULES:
        importlib.import_module(module)
    return dict(_RUNTIMES)


def select_runtimes(names, providers=None) -> tuple[list[Runtime], dict[str, str]]:
    """The runtimes `names` asks for, ONNX Runtime first, and those `all` leaves out with the reason.

    Args:
        names: runtime names, "all" among them for every installed one; None or empty: ONNX Runtime alone.
        providers: ONNX Runtime's providers asked for, which need it among the runtimes; None or empty: none.

    Raises:
        InputError: an unknown name, a runtime asked for by name that is not installed (naming its install), or
            providers without ONNX Runtime.
    """
    if isinstance(names, str):  # iterated, "openvino" would be the runtimes "o", "p", ...
        names = [names]
    if not isinstance(names, (list, tuple, type(None))):
        raise InputError(f"runtimes must be a list of runtime names, got {names!r:.80} (`runtimes`)")
    table = registered_runtimes()
    names = list(dict.fromkeys(names or [DEFAULT_RUNTIME]))
    unknown = [name for name in names if name != ALL and name not in table]
    if unknown:
        raise InputError(f"unknown runtime {unknown[0]!r}; choose from {', '.join([*table, ALL])} (`runtimes`)")
    chosen, skipped = [], {}
    for name in dict.fromkeys([*names, *table]) if ALL in names else names:
        if name == ALL:
            continue
        runtime = table[name]
        if runtime.version() is not None:
            chosen.append(runtime)
        elif name in names:  # asked for by name: its absence is the user's to fix
            raise InputError(f"runtime {name} is not installed here: {runtime.install} (`runtimes`)")
        else:
            skipped[name] = f"not installed ({runtime.install})"
    if providers and DEFAULT_RUNTIME not in [runtime.name for runtime in chosen]:
        raise InputError(
            f"providers are ONNX Runtime's execution providers, and the runtimes asked for leave out "
            f"{DEFAULT_RUNTIME}; add {DEFAULT_RUNTIME} to them (`runtimes`), or drop `providers`"
        )
    chosen.sort(key=lambda runtime: runtime.name != DEFAULT_RUNTIME)  # ONNX Runtime's rows first, as the reference's
    return chosen, skipped
