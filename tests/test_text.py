"""Text that stays true: the files the code's docstrings and comments send a reader to are in the repository, and the
README's layout lists every benchmark script."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("exporter", "reference", "benchmarks", "examples")
MARKDOWN = re.compile(r"[\w./-]+\.md\b")


def _dangling(text: str, present: set[str]) -> list[str]:
    """The Markdown names in `text` that are no file of the repository, by path from its root or by file name."""
    names = {path.rsplit("/", 1)[-1] for path in present}
    return sorted({name for name in MARKDOWN.findall(text) if name not in present and name not in names})


def test_every_markdown_file_the_code_names_is_in_the_repository():
    present = {str(p.relative_to(ROOT)) for p in ROOT.glob("**/*.md") if not {".venv", ".git"} & set(p.parts)}
    dangling = [
        f"{path.relative_to(ROOT)}: {name}"
        for folder in CODE
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in (".py", ".sh")
        for name in _dangling(path.read_text(), present)
    ]
    assert not dangling, "\n".join(dangling)


def test_the_check_of_named_files_sees_one_outside_the_repository():
    present = {"docs/design.md", "benchmarks/RESULTS.md"}
    text = "see docs/design.md, RESULTS.md, ../shared/ECOSYSTEM.md and REFERENCE-MODELS.md section 3"
    assert _dangling(text, present) == ["../shared/ECOSYSTEM.md", "REFERENCE-MODELS.md"]


def test_the_readme_layout_lists_every_benchmark_script():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Repository layout", 1)[1].split("```")[1]
    entry = layout.split("\nbenchmarks/", 1)[1].split("\nexamples/", 1)[0]
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert scripts and not [name for name in scripts if name not in entry], entry
