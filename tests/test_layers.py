"""The package's layers, as docs/design.md draws them: each imports only the layers below it, never one above, and
never a sibling of its own rank."""

import ast
import re
from pathlib import Path

import exporter

PACKAGE = Path(exporter.__file__).parent
REFERENCE = PACKAGE.parent / "reference"
# Lowest first; a rank may hold siblings, which never import each other. errors is the one error hierarchy;
# tolerances the profiles both the export's own checks and the verification judge by; export (PyTorch model ->
# artifact) and verify (artifact + reference -> report) are siblings; tuning (an export made to a quality target)
# needs both; cli (the commands and the pytest plugin) is the top.
LAYERS = [("errors",), ("artifact",), ("runtime",), ("tolerances",), ("export", "verify"), ("tuning",), ("cli",)]
NAMES = [name for rank in LAYERS for name in rank]
# The reference models (the top-level reference/ package) sit beside artifact: they read its files and raise its
# errors, and export, runtime and verify build on them.
REFERENCE_IMPORTS = ("errors", "artifact")


def _rank(layer: str) -> int:
    return next(i for i, rank in enumerate(LAYERS) if layer in rank)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "exporter" or len(parts) < 2:
        return None  # another package, or exporter's own public API (resolved lazily, never imported from)
    return parts[1]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports included
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _forbidden(own: str, imported: str) -> bool:
    """Whether a module of layer `own` may not import from layer `imported`: one above, or a sibling."""
    return _rank(imported) > _rank(own) or (imported != own and _rank(imported) == _rank(own))


def _offences(path: Path, own: str) -> list[str]:
    return [
        f"{path.name} ({own}) imports {name} ({layer})"
        for name in sorted(_imports(path))
        if (layer := _layer(name)) is not None and _forbidden(own, layer)
    ]


def test_every_module_belongs_to_a_layer():
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts != ("__init__.py",):
            assert parts[0].removesuffix(".py") in NAMES, path


def test_imports_only_go_down_the_layers():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts != ("__init__.py",):
            offences += [f"{relative.parent}/{o}" for o in _offences(path, relative.parts[0].removesuffix(".py"))]
    assert not offences, "\n".join(offences)


def test_the_reference_models_import_only_errors_and_artifact():
    above = [
        f"reference/{path.name} imports {name}"
        for path in sorted(REFERENCE.glob("*.py"))
        for name in sorted(_imports(path))
        if (layer := _layer(name)) is not None and layer not in REFERENCE_IMPORTS
    ]
    assert not above, "\n".join(above)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    # the check itself can fail: a runtime module importing the verification engine is caught
    source = tmp_path / "runner.py"
    source.write_text("def f():\n    from exporter.verify.engine import verify_artifact\n")
    assert _offences(source, "runtime") == [
        "runner.py (runtime) imports exporter.verify.engine.verify_artifact (verify)"
    ]


def test_export_and_verify_may_not_import_each_other(tmp_path):
    # siblings: the check fails on an import either way, and passes on one from a layer below both
    source = tmp_path / "pipeline.py"
    source.write_text("from exporter.verify.tolerances import profile_for\nfrom exporter.tolerances import Tolerance\n")
    assert _offences(source, "export") == [
        "pipeline.py (export) imports exporter.verify.tolerances.profile_for (verify)"
    ]
    source.write_text("from exporter.export.pipeline import export_artifact\n")
    assert _offences(source, "verify") == [
        "pipeline.py (verify) imports exporter.export.pipeline.export_artifact (export)"
    ]


def _bullet_heads(docstring: str) -> list[list[str]]:
    """The names each `- ` bullet of a docstring begins with, before its colon: `- export/ and verify/:` gives
    ["export", "verify"]; `- inputs: ...; metrics: ...` gives ["inputs", "metrics"] (a bullet may list several
    modules, each after a semicolon)."""
    bullets = re.findall(r"^- (.*?)(?=^- |^\S|\Z)", docstring, flags=re.M | re.S)
    return [
        [
            name.strip().removesuffix("/")
            for head in re.findall(r"(?:^|; )([\w/ ]+?):", " ".join(b.split()))
            for name in re.split(r" and | / ", head)
        ]
        for b in bullets
    ]


def test_the_package_docstring_names_the_layers_in_their_order():
    heads = [
        tuple(names) for names in _bullet_heads(ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())))
    ]
    assert heads == LAYERS


def test_each_package_docstring_lists_its_own_modules():
    """A package docstring with bullets names each of its modules and subpackages, and nothing else."""
    wrong = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        if init.parent == PACKAGE:
            continue
        heads = _bullet_heads(ast.get_docstring(ast.parse(init.read_text())) or "")
        if heads:
            listed = {name for names in heads for name in names}
            modules = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
            modules |= {p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()}
            if listed != modules:
                wrong.append(
                    f"{init.relative_to(PACKAGE)}: lists {sorted(listed - modules)}, omits {sorted(modules - listed)}"
                )
    assert not wrong, "\n".join(wrong)


def test_the_design_document_draws_the_same_order():
    order = " < ".join(" | ".join(rank) for rank in LAYERS)
    assert f"The order is {order}" in (PACKAGE.parent / "docs" / "design.md").read_text()
