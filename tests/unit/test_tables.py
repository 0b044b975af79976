"""The one table formatter: every stage's log and report tables are laid out by include/dflash_regen/tables.py."""

from dflash_regen.tables import Column, markdown_table, text_table


def test_a_text_table_aligns_formats_and_cuts_each_column_under_a_rule_as_long_as_its_header():
    columns = (Column("server", 8), Column("tokens", 9, ">", ","), Column("secs", 5, ">", ".1f"),
               Column("note", 4, spec=".4"), Column("binding", gap=2))
    table = text_table(columns, [("s0", 1234567, 2.25, "truncated", "KV tokens"), ("server 10", 0, 0, "", None)])
    assert table.splitlines() == [
        "server      tokens  secs note  binding",
        "--------------------------------------",
        "s0       1,234,567   2.2 trun  KV tokens",
        "server 10         0   0.0       None",  # a value wider than its column pushes the rest, as f-strings do
    ]
    assert text_table(columns[:1], [], rule=12).splitlines() == ["server  ", "-" * 12]


def test_a_markdown_table_pads_each_column_to_its_widest_cell_or_leaves_cells_as_they_are():
    head, rows = ["name", "tok/s"], [["as run", "1,477"], ["MTP off", ""]]
    assert markdown_table(head, rows).splitlines() == [
        "| name    | tok/s |",
        "|---------|-------|",
        "| as run  | 1,477 |",
        "| MTP off |       |",
    ]
    assert markdown_table(head, rows, padded=False).splitlines() == [
        "| name | tok/s |",
        "|---|---|",
        "| as run | 1,477 |",
        "| MTP off |  |",
    ]
