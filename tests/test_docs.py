"""The docs describe the project as it is: no narration of how it was built, no citation of a missing result.

Narration words are checked in README.md, docs/*.md and bench/README.md (``NARRATION``); in the comments and
docstrings of codagen/ and bench/*.py, less the words code says of itself ("now", "re-run", "the earlier": a kernel
re-runs, waits for the earlier kernels; ``CODE_NARRATION``); and in docs/notes/*.md, topic notes dated once, which
may also name the commit they measured ("at commit ..."; ``NOTE_NARRATION``).
Every ``bench/results/...`` path (globs included) and every shorthand result name (`` `-xyz.json` ``,
``bench/results/*-xyz.json``) cited in README.md, docs/, docs/notes/ and bench/README.md must exist, and so must
every other repository path (``codagen/``, ``tests/``, ``bench/``, ``docs/``; globs match something), the test
function of a test id (``tests/x.py::test_name``) and the module and first attribute of a dotted
``codagen.module.name``. A path written as ``git show <commit>:path`` cites a commit, not the tree, and is not
checked; neither is a bare mention of a path the same document cites that way.
"""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DESCRIBING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
NOTES = sorted((ROOT / "docs" / "notes").glob("*.md"))
CITING = DESCRIBING + NOTES
SOURCES = sorted((ROOT / "codagen").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))

# how the work went, what the code was, who did it: history lives in git
HISTORY = [r"\bsessions?\b", r"\bafter the review\b", r"-before-", r"\bwe tried\b",
           r"\b(?:it|this|which|that) replaced\b", r"\bpreviously\b", r"\bformerly\b", r"\bpreceded\b",
           r"\bused to (?:be|take|run|have|do)\b", r"\bno longer\b", r"\bthe issue\b", r"\blent\b",
           r"\bat commit\b", r"\bhas not (?:been )?run\b",
           r"\b(?:before|after) (?:the|this) (?:change|fix|refactor|rewrite)\b", r"\b(?:was|were|got) fixed\b",
           r"\bthe current (?:code|form|version)\b"]


def _words(phrases: list[str]) -> re.Pattern:
    """Any of ``phrases``, case-insensitive, a phrase's words also matched across a line break."""
    return re.compile("|".join(phrases).replace(" ", r"\s+"), re.IGNORECASE)


CODE_NARRATION = _words(HISTORY)
NOTE_NARRATION = _words([h for h in HISTORY if h != r"\bat commit\b"])
NARRATION = _words(HISTORY + [r"\bre-?run", r"\bnow\b", r"\bthe earlier\b"])
RESULT_PATH = re.compile(r"(?<![\w:/.-])bench/results/([\w.*-]+)")
SHORTHAND = re.compile(r"`(-[\w.-]+\.(?:json|md|txt|png|csv))`")
REPO_PATH = re.compile(r"(?<![\w:/.-])((?:codagen|tests|bench|docs)/[\w./*-]*[\w*/])(?:::(\w+))?")
COMMIT_PATH = re.compile(r"\b[0-9a-f]{7,40}(?:~\d+|\^)?:((?:codagen|tests|bench|docs)/[\w./-]*\w)")
DOTTED = re.compile(r"(?<![\w/.-])codagen((?:\.\w+)+)(\*?)")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def narration(text: str, pattern: re.Pattern = NARRATION) -> list[str]:
    return [f"line {_line_of(text, m.start())}: {m.group(0)!r}" for m in pattern.finditer(text)]


def comments_and_docstrings(source: str) -> str:
    """``source`` with everything but its comments and triple-quoted strings blanked, lines kept."""
    lines = [""] * len(source.splitlines())
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        text = token.string
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and
                                              text.lstrip("rbuRBU").startswith(('"""', "'''"))):
            for i, part in enumerate(text.splitlines()):
                lines[token.start[0] - 1 + i] += " " + part
    return "\n".join(lines)


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
    assert narration("0.2 ms against the\n  earlier kernel's 2.2 ms") == ["line 1: 'the\\n  earlier'"]
    for phrase in ("the kernel it replaced", "This replaced recomputing", "the earlier kernel", "as previously",
                   "formerly a loop", "the kernel that preceded it", "it used to take 3 ms", "is no longer needed",
                   "the op now makes dlogits", "the issue's choice", "no two GPUs lent", "ran at commit 5b0849a",
                   "has not run yet", "after the refactor", "before this change", "the bug was fixed",
                   "the current code has one kernel"):
        assert narration(phrase), phrase
    assert not narration("peak memory above what was allocated before it; the LM head's fixed tile")
    assert narration("# x is no longer copied", CODE_NARRATION) and narration("the kernel it replaced", NOTE_NARRATION)
    assert not narration("measured at commit 9e6fdaf", NOTE_NARRATION)
    assert not narration("# re-runs the kernel, now", CODE_NARRATION)
    assert comments_and_docstrings('x = 1  # no longer\n"""doc"""\ny = "now"\n') == ' # no longer\n """doc"""\n'
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


@pytest.mark.parametrize("path", [pytest.param(p, id=_name(p)) for p in NOTES])
def test_notes_do_not_narrate(path):
    hits = narration(path.read_text(), NOTE_NARRATION)
    assert not hits, f"{_name(path)} narrates how the work went: {hits}"


@pytest.mark.parametrize("path", [pytest.param(p, id=_name(p)) for p in SOURCES])
def test_comments_and_docstrings_do_not_narrate(path):
    hits = narration(comments_and_docstrings(path.read_text()), CODE_NARRATION)
    assert not hits, f"{_name(path)} narrates how the work went: {hits}"


@pytest.mark.parametrize("path", [p for p in CITING if p.exists()], ids=_name)
def test_cited_results_exist(path):
    missing = dangling_results(path.read_text())
    assert not missing, f"{_name(path)} cites results that bench/results/ does not hold: {missing}"


@pytest.mark.parametrize("path", [p for p in CITING if p.exists()], ids=_name)
def test_cited_paths_exist(path):
    missing = dangling_paths(path.read_text())
    assert not missing, f"{_name(path)} cites paths or names the tree does not hold: {missing}"
