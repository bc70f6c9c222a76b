"""The manual's shape: README table cells stay readable, the reference pages stay short enough to read in one sitting,
and every relative link in README and docs reaches a file of the checkout."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "docs" / "experiments").glob("*.md"), *(ROOT / "docs" / "bench").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_no_readme_table_cell_is_over_300_characters():
    long = []
    for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if line.startswith("|"):
            long += [(n, len(c)) for c in re.split(r"(?<!\\)\|", line.strip().strip("|")) if len(c.strip()) > 300]
    assert not long, f"README lines and cell lengths: {long}"


@pytest.mark.parametrize("page", ["engines.md", "benchmarks.md"])
def test_reference_pages_are_at_most_400_lines(page):
    assert len((ROOT / "docs" / page).read_text().splitlines()) <= 400


def test_every_relative_link_reaches_a_file():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z]+:", path):
                continue  # an anchor on the same page, or a URL
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)
