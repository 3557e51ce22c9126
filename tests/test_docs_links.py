"""Every relative link in the README, docs/ and benchmarks/HISTORY.md reaches a file, and every #anchor a heading
of it (GitHub's rule: lower case, punctuation dropped, spaces to dashes): sections move between docs/benchmarks.md
and the history, and a link left behind would lead nowhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "HISTORY.md"]


def anchors(page: Path) -> set[str]:
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    return broken


def test_every_relative_link_in_the_docs_reaches_its_file_and_heading():
    broken = {str(p.relative_to(ROOT)): b for p in PAGES if (b := broken_links(p))}
    assert not broken, broken


def test_a_link_to_a_missing_heading_or_file_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Kept: it\n\n[ok](#kept-it) [gone](#moved) [file](nowhere.md) [web](https://x.org)\n"
                    "```\n# not a heading\n```\n[code](#not-a-heading)\n")
    assert broken_links(page) == ["#moved: no heading #moved in page.md", "nowhere.md: no such file",
                                  "#not-a-heading: no heading #not-a-heading in page.md"]
