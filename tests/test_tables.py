"""labkit.tables: summary rows in aligned columns."""

import pytest

import labkit
from labkit.tables import format_rows


def test_columns_are_as_wide_as_their_widest_cell_and_the_last_is_not_padded():
    rows = [("budget", "2.9 MiB"), ("plain step peak", "25 MiB", "over")]
    assert format_rows(rows).splitlines() == ["budget           2.9 MiB",
                                              "plain step peak  25 MiB   over"]


def test_right_aligned_columns_and_bad_alignment():
    assert format_rows([("a", 1, "x"), ("bb", 100, "y")], "<>").splitlines() == ["a     1  x", "bb  100  y"]
    with pytest.raises(ValueError, match="align"):
        format_rows([("a", 1)], "<^")


def test_print_rows_is_labkits(capsys):
    labkit.print_rows([("k", "v")])
    assert capsys.readouterr().out == "k  v\n"
