"""The one table printer: known answers for text and Markdown tables."""

from __future__ import annotations

import pytest

from capture_format.tables import markdown_table, text_table


def test_labels_left_numbers_right_and_no_trailing_spaces() -> None:
    table = text_table([("TTT step 0 accuracy", "0.412", "0.05"), ("k=1", "1.300", "11.000")],
                       header=("", "draft", "unigram"))
    assert table.splitlines() == [
        "                     draft  unigram",
        "TTT step 0 accuracy  0.412     0.05",
        "k=1                  1.300   11.000",
    ]


def test_key_value_rows_with_an_indent_and_a_short_row() -> None:
    table = text_table([("records", "12"), ("damaged shards", "0 (none)"), ("note",)], align="<<", indent="  ")
    assert table == "  records         12\n  damaged shards  0 (none)\n  note"


@pytest.mark.parametrize("align", ["<", "<>>", "<^"])
def test_an_alignment_that_does_not_fit_the_columns_is_refused(align: str) -> None:
    with pytest.raises(ValueError, match="must hold one of < or > for each of the 2 columns"):
        text_table([("a", "b")], align=align)


def test_markdown_table_escapes_a_pipe_inside_a_cell() -> None:
    assert markdown_table(["part", "default"], [("trainer", "a|b"), ("plugin", "1")]) == (
        "| part | default |\n|---|---|\n| trainer | a&#124;b |\n| plugin | 1 |")
