"""workbook.readtime: the reading-time formula over a notebook, its appendix and the tests' cells left out; nbval's
check of the default runs (tests/conftest.py)."""

import json
from pathlib import Path

import nbformat

from workbook import readtime

pytest_plugins = ("pytester",)


def _notebook(cells) -> dict:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    return json.loads(nbformat.writes(nb))


def _code(source, *outputs):
    cell = nbformat.v4.new_code_cell(source)
    cell.outputs = list(outputs)
    return cell


def test_prose_output_and_code_are_read_at_their_rates():
    words = " ".join(["word"] * 400)  # 2 minutes of prose
    printed = nbformat.v4.new_output("stream", name="stdout", text=" ".join(["n"] * 300))  # 2 minutes of output
    result = nbformat.v4.new_output("execute_result", data={"text/plain": "a b c"}, execution_count=1)
    image = nbformat.v4.new_output("display_data", data={"image/png": "AAAA", "text/plain": "<Figure 1 Axes>"})
    code = "\n".join(["x = 1"] * 30) + "\n\n   \n"  # 3 minutes of code; blank lines count nothing
    r = readtime.reading(_notebook([nbformat.v4.new_markdown_cell(words), _code(code, printed, result, image)]), "t")
    assert (r.prose_words, r.output_words, r.code_lines, r.appendix_cells) == (400, 303, 30, 0)
    assert abs(r.minutes - (2 + 303 / 150 + 3)) < 1e-9


def test_the_appendix_and_the_tests_cells_are_left_out_until_the_next_heading_of_its_level():
    md = nbformat.v4.new_markdown_cell
    cells = [md("# Title\none two"), _code("a = 1"),
             md("## Appendix: machinery\nskipped words here"), _code("b = 2\nc = 3"), md("### a subsection\nalso skipped"),
             md("## Further reading\nthree more words"), _code("# (added by the tests: the panel)\npanel()")]
    r = readtime.reading(_notebook(cells))
    assert (r.prose_words, r.code_lines, r.appendix_cells) == (4 + 6, 1, 4)  # (a heading's hashes count as a word: split on spaces)


def test_a_comment_in_a_fenced_block_is_not_a_heading():
    md = nbformat.v4.new_markdown_cell
    cells = [md("# Title"), md("## Appendix A: machinery\n```bash\n# one machine\ntorchrun x.py\n```\nskipped"),
             md("still the appendix"), md("## Further reading\nread")]
    r = readtime.reading(_notebook(cells))
    assert (r.prose_words, r.appendix_cells) == (2 + 4, 2)


def test_the_command_exits_1_over_the_limit_and_2_without_notebooks(tmp_path, capsys):
    assert readtime.main([str(tmp_path)]) == 2
    long = _notebook([_code("\n".join(["x = 1"] * 700))])  # 70 minutes of code
    (tmp_path / "01_long.ipynb").write_text(json.dumps(long))
    (tmp_path / "02_short.ipynb").write_text(json.dumps(_notebook([_code("x = 1")])))
    assert readtime.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "| 01_long | 0 | 0 | 700 | 70 | no, over 60 |" in out and "| 02_short | 0 | 0 | 1 | 0 | yes |" in out
    assert readtime.main([str(tmp_path), "--limit-min", "80"]) == 0


def test_nbval_fails_a_chapter_whose_run_prints_it_past_a_sitting(pytester):
    """The suite's nbval run checks each chapter's default reading time (tests/conftest.py), its outputs counted, for
    notebooks outside the conftest's folder (as build/nbval is)."""
    conftest = Path(__file__).with_name("conftest.py")
    pytester.mkdir("tests")
    (pytester.path / "tests" / "conftest.py").write_text(f"""
import importlib.util
spec = importlib.util.spec_from_file_location("conftest_under_test", {str(conftest)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)


def pytest_configure(config):
    config.pluginmanager.register(module.ChapterReadingTime())
""")
    (pytester.path / "tests" / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    prose = nbformat.v4.new_markdown_cell(" ".join(["word"] * 11_900))  # 59.5 minutes: under a sitting unrun
    printing = nbformat.v4.new_code_cell("print(' '.join(['n'] * 150))")  # 1 minute of output once run, 0.1 of code
    nb = nbformat.v4.new_notebook(cells=[prose, nbformat.v4.new_code_cell("x = 1"), printing])
    pytester.mkdir("nbval")
    nbformat.write(nb, pytester.path / "nbval" / "99_long.ipynb")
    assert readtime.reading(json.loads(nbformat.writes(nb))).minutes < readtime.LIMIT_MIN
    result = pytester.runpytest_inprocess("tests", "nbval", "--nbval-lax", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*99_long: 60.7 minutes to read with its default parameters*over a sitting's 60*",
                                 "minutes to read each chapter's default run*: 99 60.7"])
