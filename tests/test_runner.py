"""workbook.runner executes real notebooks with papermill and collects their records into results.json and report.html."""

from __future__ import annotations

import json

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from workbook import nbcheck, report, runner

GOOD = "00_good"
BAD = "01_bad"


def _write(path, cells):
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@pytest.fixture
def notebooks(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    params = new_code_cell("SEED = 0")
    params.metadata["tags"] = ["parameters"]
    _write(folder / f"{GOOD}.ipynb", [
        new_markdown_cell("# Good notebook"),
        params,
        new_code_cell("from labkit.results import record\nrecord('answer', 42)\nrecord('seed', SEED)"),
        new_markdown_cell("## The line plot"),
        new_code_cell("%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"),
        new_code_cell("from labkit import plots\nfig, ax = plots.new_figure()\nax.plot([1, 2], [3, 4])\n"
                      "ax.set(title='Complete', xlabel='batch (samples)', ylabel='peak (MiB)')\nplots.show(fig)"),
    ])
    _write(folder / f"{BAD}.ipynb", [
        new_code_cell("from labkit.results import record\nrecord('before', 1.5)"),
        new_code_cell("raise ValueError('broken <on purpose> & loudly')"),
        new_code_cell("record('after', 2)"),
    ])
    # Files the runner must ignore.
    _write(folder / "02_thing.student.ipynb", [new_code_cell("raise RuntimeError('must not run')")])
    _write(folder / "scratch.ipynb", [new_code_cell("raise RuntimeError('must not run')")])
    return folder


def test_find_notebooks_filters_and_sorts(notebooks):
    assert [p.name for p in nbcheck.find_notebooks(notebooks)] == [f"{GOOD}.ipynb", f"{BAD}.ipynb"]
    assert [p.name for p in nbcheck.find_notebooks(notebooks, only=["01"])] == [f"{BAD}.ipynb"]


def test_format_value():
    assert report.format_value("peak_bytes", 3 * 2**20) == "3,145,728 (3.0 MiB)"
    assert report.format_value("loss", 0.123456) == "0.1235"
    assert report.format_value("xs", list(range(500))).endswith("...")
    assert len(report.format_value("xs", list(range(500)))) <= report.VALUE_CHARS


@pytest.mark.notebook
def test_main_runs_all_and_reports(notebooks, tmp_path, capfd, monkeypatch):
    import papermill.engines

    monkeypatch.delenv("LABKIT_BATCH", raising=False)
    writes = []  # the executed notebooks' writes: at the end (and every SAVE_EVERY_S), not twice a cell
    monkeypatch.setattr(papermill.engines, "write_ipynb", lambda nb, path, write=papermill.engines.write_ipynb:
                        writes.append(path) or write(nb, path))
    out = tmp_path / "out"
    code = runner.main(["--notebooks", str(notebooks), "--out", str(out), "-p", "SEED", "7", "--timeout-s", "120"])
    assert code == 1
    assert 1 <= writes.count(str(out / "notebooks" / f"{GOOD}.ipynb")) <= 2, writes  # (papermill's own: 16 for its 7)
    printed = capfd.readouterr()  # the kernels' own stderr too (file descriptor 2 is inherited)
    assert f"[1/2] {GOOD} ... ok" in printed.out and f"[2/2] {BAD} ... failed" in printed.out
    assert "without encryption" not in printed.out + printed.err  # ipykernel's TCP warning, once per kernel

    results = json.loads((out / "results.json").read_text())
    assert set(results) >= {"generated_utc", "hardware", "torch", "parameters", "notebooks"}
    assert results["parameters"] == {"SEED": 7}
    assert set(results["notebooks"]) == {GOOD, BAD}

    good = results["notebooks"][GOOD]
    assert good["status"] == "ok" and "error" not in good
    assert good["measurements"] == {"answer": 42, "seed": 7}
    assert good["wall_s"] > 0
    assert good["executed"] == f"notebooks/{GOOD}.ipynb"
    # Each figure was checked as the kernel drew it: the bare pyplot figure (cell 4 of the notebook, after
    # papermill's injected cell is left out) has no title and no axis labels; the labelled one (cell 5) passes.
    problems = good["figure_problems"]
    assert {p["cell"] for p in problems} == {4}, problems
    assert any("no title" in p["problem"] for p in problems)
    assert any("numeric x axis has no label" in p["problem"] for p in problems)
    assert not (out / "notebooks" / f"{GOOD}.figures.jsonl").exists()

    bad = results["notebooks"][BAD]
    assert bad["status"] == "failed"
    assert "ValueError" in bad["error"] and "broken <on purpose>" in bad["error"]
    assert bad["measurements"] == {"before": 1.5}

    for stem in (GOOD, BAD):
        assert (out / "notebooks" / f"{stem}.ipynb").exists()
    assert not (out / "notebooks" / "02_thing.student.ipynb").exists()

    report = (out / "report.html").read_text()
    assert GOOD in report and BAD in report
    assert "broken &lt;on purpose&gt; &amp; loudly" in report
    assert "broken <on purpose>" not in report
    assert "data:image/png;base64," in report
    assert "The line plot" in report
    assert "Figure check" in report and "no title (and no suptitle)" in report
    assert "<script" not in report and 'src="http' not in report and "<link" not in report
    # The runner restores the environment after running.
    import os
    assert "LABKIT_BATCH" not in os.environ


def test_a_cell_past_its_timeout_leaves_the_cells_before_it_written(tmp_path):
    from labkit import execute

    path = tmp_path / "slow.ipynb"
    _write(path, [new_code_cell("print('before the slow cell')"), new_code_cell("import time\ntime.sleep(120)"),
                  new_code_cell("print('never')")])
    entry = execute.run_notebook(path, tmp_path / "out" / path.name, {}, timeout_s=5)
    assert entry["status"] == "failed" and "Timeout" in entry["error"], entry
    nb = nbformat.read(tmp_path / "out" / path.name, as_version=4)  # written once, at the end, all the same
    assert nb.cells[0].outputs[0]["text"] == "before the slow cell\n" and nb.cells[2].outputs == []
    assert nb.cells[1].metadata.papermill["start_time"] is not None and entry["wall_s"] < 60


@pytest.mark.notebook
def test_batch_env_reaches_the_kernel(tmp_path, monkeypatch):
    monkeypatch.delenv("LABKIT_BATCH", raising=False)
    folder = tmp_path / "nb"
    folder.mkdir()
    (folder / "data.txt").write_text("hello")
    _write(folder / "05_env.ipynb", [new_code_cell(
        "from labkit import record, is_batch\n"
        "record('batch', is_batch())\n"
        "record('text', open('data.txt').read())"
    )])
    out = tmp_path / "out"
    assert runner.main(["--notebooks", str(folder), "--out", str(out)]) == 0
    entry = json.loads((out / "results.json").read_text())["notebooks"]["05_env"]
    assert entry["measurements"] == {"batch": True, "text": "hello"}


def test_bad_notebooks_dir_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        runner.main(["--notebooks", str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    assert "--notebooks" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_only_matching_nothing_exits_2(notebooks, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        runner.main(["--notebooks", str(notebooks), "--out", str(tmp_path / "out"), "--only", "99"])
    assert info.value.code == 2
    assert "--only" in capsys.readouterr().err


@pytest.mark.notebook
def test_only_merges_into_existing_results(notebooks, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    earlier = {"status": "ok", "wall_s": 3.0, "measurements": {"kept": 1}, "executed": "notebooks/09_other.ipynb"}
    (out / "results.json").write_text(json.dumps({"notebooks": {"09_other": earlier}}))
    assert runner.main(["--notebooks", str(notebooks), "--out", str(out), "--only", "00"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["notebooks"]) == {GOOD, "09_other"}
    assert results["notebooks"]["09_other"] == earlier
    assert results["notebooks"][GOOD]["measurements"] == {"answer": 42, "seed": 0}
    assert "09_other" in (out / "report.html").read_text()


@pytest.mark.notebook
def test_a_later_notebook_reads_this_runs_results_of_the_earlier_ones(tmp_path, monkeypatch):
    """The closing page (10) runs last and reads results.json: it must find this run's figures, not the last run's."""
    folder = tmp_path / "nb"
    folder.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"notebooks": {"00_first": {"measurements": {"x": "stale"}}}}))
    monkeypatch.setenv("LABKIT_RESULTS", str(tmp_path / "another-run.json"))  # the run's own wins, wherever OUT is
    _write(folder / "00_first.ipynb", [new_code_cell("from labkit import record\nrecord('x', 'fresh')")])
    _write(folder / "01_later.ipynb", [new_code_cell(  # as chapters 07 and 10 read the others' figures
        "import json\nfrom labkit import record\nfrom labkit.results import results_path\n"
        "r = json.load(open(results_path()))\n"
        "record('seen', r['notebooks']['00_first']['measurements']['x'])")])
    assert runner.main(["--notebooks", str(folder), "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["notebooks"]["01_later"]["measurements"] == {"seen": "fresh"}


def test_crowded_sections_counts_pass_lines_under_each_heading():
    """A section is the text under one heading (any level); two PASS lines in one section are reported."""
    from nbformat.v4 import new_output

    from workbook.nbcheck import crowded_sections, pass_lines_by_section

    def ran(*lines):
        cell = new_code_cell("print(...)")
        cell.outputs = [new_output("stream", name="stdout", text="".join(f"{line}\n" for line in lines))]
        return cell

    nb = new_notebook(cells=[ran("PASS: before any heading"), new_markdown_cell("## One\ntext"),
                             ran("measured 3", "PASS: one"), new_markdown_cell("### One, a"), ran("PASS: a"),
                             ran("PASS: a again"), new_markdown_cell("no heading here"), ran("PASS: still a"),
                             new_markdown_cell("## Two"), ran("a line that ends in PASS")])
    assert pass_lines_by_section(nb) == {"(top)": 1, "One": 1, "One, a": 3}
    assert crowded_sections(nb) == ["One, a: 3 PASS lines"]
    assert crowded_sections(new_notebook(cells=[new_markdown_cell("## Two"), ran("PASS: two")])) == []


@pytest.mark.notebook
def test_a_kernel_listens_on_socket_files_of_its_own_that_go_with_it(tmp_path):
    """No TCP port to lose to another process between jupyter_client's choice and the kernel's bind (a CI run's
    "Address already in use"): papermill's kernels, and nbval's (tests/conftest.py), talk over Unix sockets."""
    import glob

    import nbval.kernel

    from labkit import execute

    path = tmp_path / "conn.ipynb"
    _write(path, [new_code_cell("import glob, json\nfrom ipykernel.connect import get_connection_info\n"
                                "from labkit import record\ninfo = json.loads(get_connection_info())\n"
                                "record('transport', info['transport'])\nrecord('ip', info['ip'])\n"
                                "record('files', len(glob.glob(info['ip'] + '-*')))")])
    entry = execute.run_notebook(path, tmp_path / "out" / path.name, {}, timeout_s=60)
    seen = entry["measurements"]
    assert entry["status"] == "ok" and seen["transport"] == "ipc" and seen["files"] == 5, entry  # shell, iopub, ...
    assert len(seen["ip"]) < 90 and not glob.glob(seen["ip"] + "-*")  # short enough for a socket; removed after
    assert nbval.kernel.KernelManager().transport == "ipc"
