"""benchmarks/results/ stays a small folder that its README.md indexes: every file in it is named there,
and every result that README.md and docs/ point to is in it (a removed result is cited by its commit)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MAX_FILES = 80
RESULT_PATH = re.compile(r"(?<![:\w])benchmarks/results/([A-Za-z0-9_.*\-]+)(?:#([A-Za-z0-9_\-]+))?")


def _expand(token: str) -> set[str]:
    """`stem.{md,json}` and `a_{1,2}_b` as the names they stand for."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return {token}
    return {n for alt in m.group(1).split(",") for n in _expand(token[:m.start()] + alt + token[m.end():])}


def _indexed() -> set[str]:
    index = (RESULTS / "README.md").read_text()
    return {n for token in re.findall(r"`([^`\s]+)`", index) for n in _expand(token)}


def _slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub writes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_folder_stays_small():
    files = sorted(p.name for p in RESULTS.iterdir())
    assert len(files) <= MAX_FILES, f"{len(files)} files in benchmarks/results (at most {MAX_FILES})"


def test_every_result_file_is_in_the_index():
    named = _indexed()
    missing = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md" and p.name not in named)
    assert not missing, f"not named in benchmarks/results/README.md: {missing}"


def test_the_index_expands_brace_forms():
    assert _expand("model_b1_warm_{1_db,2_db1}.{md,json}") == {
        "model_b1_warm_1_db.md", "model_b1_warm_1_db.json", "model_b1_warm_2_db1.md", "model_b1_warm_2_db1.json"}


def test_every_result_path_in_the_docs_exists():
    """A path given after a commit (`git show COMMIT:benchmarks/results/FILE`) names a file in history."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in RESULT_PATH.finditer(doc.read_text()):
            name, anchor = m.group(1).rstrip("."), m.group(2)
            paths = sorted(RESULTS.glob(name)) if "*" in name else [RESULTS / name]
            if not paths or not all(p.is_file() for p in paths):
                broken.append(f"{doc.name}: {m.group(0)}")
            elif anchor and paths[0].suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", paths[0].read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{doc.name}: {m.group(0)} (no such heading)")
    assert not broken, broken
