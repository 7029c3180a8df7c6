"""The committed results stay indexed and the README stays short."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def test_every_results_folder_is_named_in_the_results_index():
    index = (RESULTS / "README.md").read_text()
    folders = [p.name for p in RESULTS.iterdir()
               if p.is_dir() and not p.name.startswith((".", "_"))]
    assert folders, "results/ holds no folder"
    assert [name for name in folders if f"`{name}/`" not in index] == []


def test_the_indexes_are_at_most_200_lines():
    for page in (ROOT / "README.md", RESULTS / "README.md"):
        assert len(page.read_text().splitlines()) <= 200, page


def test_the_readme_two_commands_section_lists_two_commands():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Two commands\n(.*?)(?=^## )", readme, re.S | re.M).group(1)
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands


def test_checkpoints_are_never_committed():
    assert "checkpoint.pt" in (ROOT / ".gitignore").read_text().split()
