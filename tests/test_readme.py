"""The README a new user meets: the two commands first, and a settings table equal to the code's settings."""

from __future__ import annotations

import re
from pathlib import Path

from eagle_tap.settings_table import settings_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_first_commands_are_make_demo_and_make_test() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]


def test_the_settings_table_is_the_one_the_code_defines() -> None:
    text = README.read_text(encoding="utf-8")
    embedded = re.search(r"<!-- settings -->\n(.*?)\n<!-- /settings -->", text, re.S)
    assert embedded is not None, "README.md lacks the <!-- settings --> ... <!-- /settings --> block"
    assert embedded.group(1) == settings_table(), "regenerate it with `python -m eagle_tap.settings_table`"


def test_every_setting_says_what_it_means() -> None:
    rows = settings_table().splitlines()[2:]
    assert len(rows) > 50
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert len(cells) == 4 and cells[3], row
