"""The repository stands alone: no doc, module or test cites a file that is not in it.

Three rules: every `.md` file named anywhere (docs, README, CONTRIBUTING, product modules and
tests) is a file of the repository; every `.py` file named in the docs or the product modules
is one too, except the upstream files listed below; and no section citation points into a
document by a bare name ("NAME §3"): sections are cited with the repository file they are in.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Upstream files named on purpose, never copied here.
UPSTREAM = {
    "modeling_ouro.py": "the Hugging Face Ouro modelling code the model is checked against",
    "raven_modeling_minimal.py": "the Huginn authors' modelling code the golden file comes from",
    "raven_config_minimal.py": "the Huginn authors' config class, beside their modelling code",
}

_NAME = r"(?<![\w/.-])([\w][\w./-]*\.{ext})\b"
_SECTION = re.compile(r"\b([A-Z][A-Za-z_]*[A-Z])\s*§\s*\d")


def _tracked() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


def _missing(files: list[str], sources: list[str], ext: str, allowed: set[str]) -> list[str]:
    names = {Path(f).name for f in files}
    pattern = re.compile(_NAME.format(ext=ext))
    missing = []
    for source in sources:
        for number, line in enumerate((ROOT / source).read_text().splitlines(), 1):
            for ref in pattern.findall(line):
                known = ref in files or Path(ref).name in names or ref in allowed
                if not known and not any(f.endswith("/" + ref) for f in files):
                    missing.append(f"{source}:{number} names {ref}")
    return missing


def _sources(files: list[str], *, tests: bool) -> list[str]:
    roots = ("loopserve/", "docs/", "tests/") if tests else ("loopserve/", "docs/")
    top = ("README.md", "CONTRIBUTING.md")
    return [
        f
        for f in files
        if f.endswith((".py", ".md"))
        and (f.startswith(roots) or f in top)
        and f != "tests/test_citations.py"
    ]


def test_every_markdown_file_named_is_in_the_repository():
    files = _tracked()
    assert not _missing(files, _sources(files, tests=True), "md", set())


def test_every_python_file_named_in_docs_and_product_is_in_the_repository():
    files = _tracked()
    assert not _missing(files, _sources(files, tests=False), "py", set(UPSTREAM))


def test_sections_are_cited_with_their_file():
    files = _tracked()
    cited = [
        f"{source}:{number}: {line.strip()}"
        for source in _sources(files, tests=True)
        for number, line in enumerate((ROOT / source).read_text().splitlines(), 1)
        if _SECTION.search(line)
    ]
    assert not cited, cited


def test_the_rules_catch_outside_names(tmp_path, monkeypatch):
    """Control: an outside design doc, a missing module and a bare section citation are found."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "See NOTES.md and loopserve/gone.py; the rule is in SPEC §4.\n"
    )
    monkeypatch.setattr(__import__("tests.test_citations").test_citations, "ROOT", tmp_path)
    files = ["docs/a.md"]
    assert _missing(files, files, "md", set()) == ["docs/a.md:1 names NOTES.md"]
    assert _missing(files, files, "py", set()) == ["docs/a.md:1 names loopserve/gone.py"]
    assert _SECTION.search((tmp_path / "docs" / "a.md").read_text())
