"""The README documents every setting that exists (it is generated from the settings classes)."""

from __future__ import annotations

from pathlib import Path

from ops.settings_docs import settings_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_settings_table_is_current() -> None:
    # The whole table, from its first line to the blank line after it: a table that lost
    # its last rows is no match for the README's longer one.
    assert "\n\n" + settings_table() + "\n\n" in README.read_text(), (
        "README's settings table is stale: paste the output of `.venv/bin/python -c "
        "'from ops.settings_docs import settings_table; print(settings_table())'`"
    )
