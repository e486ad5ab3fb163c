"""The docs describe the project as it is: no narration of how it was built, no citation of a missing result.

README.md and docs/*.md are checked for narration words; docs/notes/*.md (topic notes, dated once) are not.
Every ``bench/results/...`` path (globs included) and every shorthand result name (`` `-xyz.json` ``,
``bench/results/*-xyz.json``) cited in README.md, docs/, docs/notes/ and bench/README.md must exist, and so must
every other repository path (``codagen/``, ``tests/``, ``bench/``, ``docs/``; globs match something), the test
function of a test id (``tests/x.py::test_name``) and the module and first attribute of a dotted
``codagen.module.name``. A path written as ``git show <commit>:path`` cites a commit, not the tree, and is not
checked; neither is a bare mention of a path the same document cites that way.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DESCRIBING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITING = DESCRIBING + sorted((ROOT / "docs" / "notes").glob("*.md")) + [ROOT / "bench" / "README.md"]

NARRATION = re.compile(r"\bsessions?\b|\bafter the review\b|\bre-?run|-before-|\bwe tried\b|\bnow faster than\b",
                       re.IGNORECASE)
RESULT_PATH = re.compile(r"(?<![\w:/.-])bench/results/([\w.*-]+)")
SHORTHAND = re.compile(r"`(-[\w.-]+\.(?:json|md|txt|png|csv))`")
REPO_PATH = re.compile(r"(?<![\w:/.-])((?:codagen|tests|bench|docs)/[\w./*-]*[\w*/])(?:::(\w+))?")
COMMIT_PATH = re.compile(r"\b[0-9a-f]{7,40}(?:~\d+|\^)?:((?:codagen|tests|bench|docs)/[\w./-]*\w)")
DOTTED = re.compile(r"(?<![\w/.-])codagen((?:\.\w+)+)(\*?)")

# README.md keeps its narrated "Status and measured speed" section until the replacement proposed beside
# this branch (README-status-proposal.md) is merged; strict, so the marker must go once it passes.


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def narration(text: str) -> list[str]:
    return [f"line {n}: {m.group(0)!r}" for n, line in enumerate(text.splitlines(), 1)
            for m in NARRATION.finditer(line)]


def dangling_results(text: str) -> list[str]:
    missing = []
    for n, line in enumerate(text.splitlines(), 1):
        for name in RESULT_PATH.findall(line):
            name = name.rstrip(".")
            if name and not list(RESULTS.glob(name)):
                missing.append(f"line {n}: bench/results/{name}")
        for name in SHORTHAND.findall(line):
            if not list(RESULTS.glob("*" + name)):
                missing.append(f"line {n}: {name}")
    return missing


def test_the_checks_catch_what_they_are_for():
    assert narration("measured in the eighth session")
    assert narration("results-before-launch-fix.json")
    assert narration("the table after the review")
    assert narration("a re-run of it") and narration("a rerun of it")
    assert not narration("the kernel runs in one launch")
    assert dangling_results("see `bench/results/no-such-file.json`")
    assert dangling_results("see `-no-such-suffix.json`")
    assert not dangling_results("`git show abc123:bench/results/no-such-file.json`")
    assert dangling_paths("see `codagen/no_such_module.py`") and dangling_paths("in tests/no_such_dir/")
    assert dangling_paths("`bench/no_such_*.py`") and dangling_paths("`docs/notes/no-such-note.md`.")
    assert dangling_paths("`tests/test_docs.py::test_no_such_test`")
    assert dangling_paths("`codagen.no_such_module`") and dangling_paths("`codagen.ops.no_such_name`")
    assert dangling_paths("`codagen.ops.kernels.no_such_*`")
    assert not dangling_paths("`codagen/ops/`, `tests/ops/test_*.py`, `bench/README.md`.")
    assert not dangling_paths("`tests/test_docs.py::test_the_checks_catch_what_they_are_for`")
    assert not dangling_paths("`codagen.ops.rms_linear`, `codagen.ops.kernels.finish_*`, `codagen.models`")
    assert not dangling_paths("`git show abc1234:bench/gone.py`; `git show abc1234~1:codagen/gone.py`")
    assert not dangling_paths("`bench/gone.py` (`git show\nabc1234:bench/gone.py`) ran")


def _module_source(parts: list[str]) -> str | None:
    path = ROOT.joinpath("codagen", *parts)
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate.read_text()
    return None


def _dangling_dotted(name: str, prefix: bool) -> str | None:
    """Why ``codagen.<name>`` names nothing: the longest module prefix must exist and, if an attribute
    follows, its source must hold that attribute's name (``finish_*``: a name starting so)."""
    parts = name.split(".")
    for split in range(len(parts), -1, -1):
        source = _module_source(parts[:split])
        if source is None:
            continue
        if split == len(parts):
            return None
        attribute = re.escape(parts[split]) + ("" if prefix and split + 1 == len(parts) else r"\b")
        module = ".".join(["codagen", *parts[:split]])
        return None if re.search(r"\b" + attribute, source) else f"{module} has no {parts[split]}"
    return "no such module"


def dangling_paths(text: str) -> list[str]:
    """Repository paths, test ids and dotted ``codagen.`` names that the tree does not hold."""
    cited_by_commit = set(COMMIT_PATH.findall(re.sub(r"\s+", " ", text)))  # a citation may wrap
    missing = []
    for n, line in enumerate(text.splitlines(), 1):
        for path, test in REPO_PATH.findall(line):
            if path.startswith("bench/results/") or path in cited_by_commit:
                continue
            files = list(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
            if not files:
                missing.append(f"line {n}: {path}")
            elif test and not re.search(rf"^\s*def {test}\b", files[0].read_text(), re.M):
                missing.append(f"line {n}: {path}::{test} (no such test)")
        for name, star in DOTTED.findall(line):
            why = _dangling_dotted(name[1:], bool(star))
            if why:
                missing.append(f"line {n}: codagen{name}{star} ({why})")
    return missing


@pytest.mark.parametrize("path", [pytest.param(p, id=_name(p))
                                  for p in DESCRIBING])
def test_docs_do_not_narrate(path):
    hits = narration(path.read_text())
    assert not hits, f"{_name(path)} narrates how the work went: {hits}"


@pytest.mark.parametrize("path", [p for p in CITING if p.exists()], ids=_name)
def test_cited_results_exist(path):
    missing = dangling_results(path.read_text())
    assert not missing, f"{_name(path)} cites results that bench/results/ does not hold: {missing}"


@pytest.mark.parametrize("path", [p for p in CITING if p.exists()], ids=_name)
def test_cited_paths_exist(path):
    missing = dangling_paths(path.read_text())
    assert not missing, f"{_name(path)} cites paths or names the tree does not hold: {missing}"
