"""The package's layers, as docs/design.md draws them: each imports only the layers below it, never one above."""

import ast
from pathlib import Path

import exporter

PACKAGE = Path(exporter.__file__).parent
# Lowest first. errors is the one error hierarchy; export sits above verify because its smoke run judges what it
# wrote with the verification's tolerances; cli (the commands and the pytest plugin) is the top.
LAYERS = ["errors", "artifact", "runtime", "verify", "export", "cli"]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "exporter" or len(parts) < 2:
        return None  # another package, or exporter's own public API (resolved lazily, never imported from)
    return LAYERS.index(parts[1])


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports included
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_every_module_belongs_to_a_layer():
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts != ("__init__.py",):
            assert parts[0].removesuffix(".py") in LAYERS, path


def test_imports_only_go_down_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts == ("__init__.py",):
            continue
        own = LAYERS.index(relative.parts[0].removesuffix(".py"))
        for name in sorted(_imports(path)):
            layer = _layer(name)
            if layer is not None and layer > own:
                upward.append(f"{relative} ({LAYERS[own]}) imports {name} ({LAYERS[layer]})")
    assert not upward, "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    # the check itself can fail: a runtime module importing the verification engine is caught
    source = tmp_path / "runner.py"
    source.write_text("def f():\n    from exporter.verify.engine import verify_artifact\n")
    assert _layer(next(iter(_imports(source)))) > LAYERS.index("runtime")
