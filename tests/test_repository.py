"""The repository stands on its own: what its files cite is in it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONVENTIONS = REPO / "docs" / "conventions.md"


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [
        REPO / name
        for name in names
        if name.endswith((".py", ".yaml", ".md", ".ipynb", ".toml")) and (REPO / name).is_file()
    ]


OUTSIDE = re.compile(r"\bSPEC\b|" + "shared" + "/")  # the project's brief lives outside the repository


def test_no_file_cites_documents_outside_the_repository():
    for path in tracked_text_files():
        assert not OUTSIDE.search(path.read_text()), (
            f"{path.relative_to(REPO)} cites a document that is not in the repository"
        )


def test_every_cited_convention_section_exists():
    sections = set(re.findall(r"^## (§\d+)", CONVENTIONS.read_text(), flags=re.M))
    assert sections == {f"§{n}" for n in range(1, 10)}
    cited = set()
    for path in tracked_text_files():
        cited |= set(re.findall(r"conventions\.md (§\d+)", path.read_text()))
        cited |= {f"§{n}" for n in re.findall(r"conventions\.md §\d+, §(\d+)", path.read_text())}
    assert cited and cited <= sections, cited - sections
