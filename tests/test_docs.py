"""The docs describe the project as it is: no narration of how it was built, no citation of a missing result.

README.md and docs/*.md are checked for narration words; docs/notes/*.md (topic notes, dated once) are not.
Every ``bench/results/...`` path (globs included) and every shorthand result name (`` `-xyz.json` ``,
``bench/results/*-xyz.json``) cited in README.md, docs/, docs/notes/ and bench/README.md must exist. A path
written as ``git show <commit>:bench/results/...`` cites a commit, not the tree, and is not checked.
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


@pytest.mark.parametrize("path", [pytest.param(p, id=_name(p))
                                  for p in DESCRIBING])
def test_docs_do_not_narrate(path):
    hits = narration(path.read_text())
    assert not hits, f"{_name(path)} narrates how the work went: {hits}"


@pytest.mark.parametrize("path", [p for p in CITING if p.exists()], ids=_name)
def test_cited_results_exist(path):
    missing = dangling_results(path.read_text())
    assert not missing, f"{_name(path)} cites results that bench/results/ does not hold: {missing}"
