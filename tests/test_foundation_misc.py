"""Records, parameter checks, devices, throughput, widget panels, plots and the running example."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

import labkit
from labkit import execute, results, validate
from labkit.device import DEVICE_CHOICES, hardware_report, resolve_device
from labkit.meter import MemoryMeter, OutOfMemory, TimelinePoint
from labkit.plots import LiveFigure, MiB, plot_memory_bars, plot_series, plot_timeline, png_bytes
from labkit.throughput import Throughput, measure_throughput, paired_ratio
from labkit.widgets import control_panel

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def clean_records():
    saved = results.recorded()
    results.clear()
    yield
    results.clear()
    results._RECORDS.update(saved)


# -- results -------------------------------------------------------------------------------------

def test_record_recorded_clear(clean_records):
    assert results.recorded() == {}
    assert labkit.record("peak_bytes", torch.tensor(4000)) is None  # a cell ending in a record shows no Out[]
    labkit.record("loss", 0.5)
    got = labkit.recorded()
    assert got == {"peak_bytes": 4000, "loss": 0.5}
    got["loss"] = 9  # a copy: the store is unchanged
    assert labkit.recorded()["loss"] == 0.5
    labkit.record("loss", 0.25)  # the latest value wins
    assert labkit.recorded()["loss"] == 0.25
    results.clear()
    assert labkit.recorded() == {}


def testjsonable_conversions():
    j = results.jsonable
    assert j(torch.tensor([1, 2])) == [1, 2]
    assert j(torch.tensor(1.5)) == 1.5
    assert j(np.float32(0.5)) == 0.5 and type(j(np.float32(0.5))) is float
    assert j(np.int64(3)) == 3 and type(j(np.int64(3))) is int
    assert j(np.array([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert j((1, (2, 3))) == [1, [2, 3]]
    assert j({1: "a", (2, 3): torch.tensor([4])}) == {"1": "a", "(2, 3)": [4]}
    assert j(float("inf")) == "inf" and j(-math.inf) == "-inf" and j(float("nan")) == "nan"
    assert j({"xs": [1.0, math.inf]}) == {"xs": [1.0, "inf"]}
    assert j(None) is None and j(True) is True and j("s") == "s"
    json.dumps(j({"a": (np.float64(1.0), torch.tensor([math.inf]))}))  # the result always serialises


@pytest.mark.parametrize("value", [object(), {1, 2}, b"bytes", [1, object()]])
def testjsonable_rejects_objects(value, clean_records):
    with pytest.raises(TypeError, match="JSON"):
        labkit.record("x", value)
    assert "x" not in labkit.recorded()


@pytest.mark.parametrize("name", ["peak bytes", "1st", "", "a-b", 3, None])
def test_record_names_must_be_identifiers(name, clean_records):
    with pytest.raises(ValueError, match="identifier"):
        labkit.record(name, 1)
    assert labkit.recorded() == {}


def test_records_from_notebook():
    mime = results.MIME_TYPE

    def payload(data):
        return new_output("display_data", data={mime: data, "text/plain": "recorded"})

    cell1 = new_code_cell("record(...)", outputs=[
        new_output("stream", name="stdout", text="hello\n"),
        payload({"name": "peak_bytes", "value": 123}),
        payload(json.dumps({"name": "step_s", "value": 0.5})),  # a payload kept as a JSON string
    ])
    cell2 = new_code_cell("record(...) on every rank", outputs=[
        payload({"name": "loss", "value": 1.0, "rank": 0}),
        payload({"name": "loss", "value": 2.0, "rank": 1}),
        payload({"name": "loss", "value": 3.0, "rank": 3}),
        new_output("execute_result", data={"text/plain": "42"}, execution_count=1),
    ])
    cell3 = new_code_cell("record('peak_bytes', 456)", outputs=[payload({"name": "peak_bytes", "value": 456})])
    nb = new_notebook(cells=[new_markdown_cell("# title"), cell1, cell2, cell3])
    assert execute.records_from_notebook(nb) == {"peak_bytes": 456, "step_s": 0.5, "loss": 1.0,
                                                 "loss@rank1": 2.0, "loss@rank3": 3.0}
    # A plain dict (nbformat JSON) reads the same.
    assert execute.records_from_notebook(json.loads(json.dumps(nb))) == execute.records_from_notebook(nb)


def test_record_shows_nothing_and_show_records_one_table(clean_records, monkeypatch, capsys):
    shown = []
    monkeypatch.setattr(results, "in_kernel", lambda: True)
    monkeypatch.setattr("IPython.display.display", lambda data, raw=False: shown.append(data))
    labkit.record("peak_bytes", 123)
    labkit.record("split", {"parameters": list(range(100))})
    assert shown == [{results.MIME_TYPE: {"name": "peak_bytes", "value": 123}},  # no text/plain: no line to read
                     {results.MIME_TYPE: {"name": "split", "value": {"parameters": list(range(100))}}}]
    results.show_records()
    table = shown[-1]
    lines = table["text/plain"].splitlines()
    assert lines[0].startswith("2 measurements recorded") and len(lines) == 3
    assert lines[1].split() == ["peak_bytes", "123"]
    assert lines[2].startswith("split ") and lines[2].endswith("...")
    assert len(lines[2]) == len("peak_bytes  ") + results.VALUE_CHARS  # the value shortened, the names aligned
    assert table["text/html"].count("<tr>") == 2 and "<code>split</code>" in table["text/html"]
    monkeypatch.setattr(results, "in_kernel", lambda: False)
    results.clear()
    results.show_records()
    assert capsys.readouterr().out == "no measurement recorded\n"


def test_an_executed_notebook_keeps_every_record_and_shows_one_table(tmp_path):
    """In a real kernel: records leave no "recorded ... =" line; the runner's reader still finds each one."""
    import nbclient

    nb = new_notebook(cells=[new_code_cell("import labkit\nlabkit.record('peak_bytes', 2**20)\nprint('hello')"),
                             new_code_cell("labkit.record('step_s', 0.25)\nlabkit.record('peak_bytes', 2**21)"),
                             new_code_cell("labkit.results.show_records()")])
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=120,
                            kernel_manager_class=execute.kernel_manager_class()).execute()
    texts = [o.get("text") or o.get("data", {}).get("text/plain", "") for c in nb.cells for o in c.outputs]
    assert not any("recorded peak_bytes =" in t or "recorded step_s =" in t for t in texts), texts
    assert [bool(o.get("data", {}).get("text/plain")) for o in nb.cells[1].outputs] == [False, False]
    assert execute.records_from_notebook(nb) == {"peak_bytes": 2**21, "step_s": 0.25}
    table = nb.cells[2].outputs[0]["data"]["text/plain"].splitlines()
    assert table[1:] == ["peak_bytes  2097152", "step_s      0.25"]


def test_every_chapter_shows_its_records_once_at_its_end():
    from pathlib import Path

    from workbook.nbcheck import find_notebooks

    for path in find_notebooks(Path(__file__).resolve().parents[1] / "notebooks"):
        cells = json.loads(path.read_text())["cells"]
        at = [i for i, c in enumerate(cells) if "show_records(" in "".join(c["source"])]
        assert len(at) == 1, f"{path.name}: {len(at)} show_records cells, one expected"
        later = [c for c in cells[at[0] + 1:] if c["cell_type"] == "code"]
        assert not later, f"{path.name}: code after the records table: {''.join(later[0]['source'])[:80]!r}"


def test_is_batch(monkeypatch):
    monkeypatch.setenv("LABKIT_BATCH", "1")
    assert labkit.is_batch()
    monkeypatch.setenv("LABKIT_BATCH", "0")
    assert not labkit.is_batch()
    monkeypatch.delenv("LABKIT_BATCH")
    assert not labkit.is_batch()


# -- parameter checks ----------------------------------------------------------------------------

def test_check_int_list():
    assert validate.check_int_list("BATCH_SWEEP", (1, 2, 4), 1, 64, min_len=2, increasing=True) == [1, 2, 4]
    with pytest.raises(validate.ParameterError, match=r"BATCH_SWEEP must be a list of at least 2 integers, got 8"):
        validate.check_int_list("BATCH_SWEEP", 8, 1, 64, min_len=2)
    with pytest.raises(validate.ParameterError, match=r"BATCH_SWEEP must be a list of 2 to 3 integers, got 1: \[4\]"):
        validate.check_int_list("BATCH_SWEEP", [4], 1, 64, min_len=2, max_len=3)
    with pytest.raises(validate.ParameterError, match=r"BATCH_SWEEP\[1\] must be an integer \[1, 64\], got 65"):
        validate.check_int_list("BATCH_SWEEP", [4, 65], 1, 64)
    with pytest.raises(validate.ParameterError, match=r"BATCH_SWEEP\[0\] must be an integer"):
        validate.check_int_list("BATCH_SWEEP", ["4"], 1, 64)
    with pytest.raises(validate.ParameterError, match=r"BATCH_SWEEP must be strictly increasing, got \[4, 4\]"):
        validate.check_int_list("BATCH_SWEEP", [4, 4], 1, 64, increasing=True)
    with pytest.raises(validate.ParameterError, match=r"must be a list"):
        validate.check_int_list("BATCH_SWEEP", "124", 1, 64)


def test_check_int():
    assert validate.check_int("BATCH", 16, 1, 4096) == 16
    with pytest.raises(validate.ParameterError, match=r"BATCH must be an integer \[1, 4096\], got 0"):
        validate.check_int("BATCH", 0, 1, 4096)
    with pytest.raises(validate.ParameterError, match=r"BATCH .*\[1, 4096\].*5000"):
        validate.check_int("BATCH", 5000, 1, 4096)
    with pytest.raises(validate.ParameterError, match=r"STEPS must be an integer >= 1, got 2.5"):
        validate.check_int("STEPS", 2.5, 1)
    with pytest.raises(validate.ParameterError, match="STEPS"):
        validate.check_int("STEPS", True, 0)
    assert issubclass(validate.ParameterError, ValueError)


def test_check_float():
    assert validate.check_float("LR", 1, 0, 1) == 1.0
    with pytest.raises(validate.ParameterError, match=r"LR must be a number in \(0, 1\], got 0"):
        validate.check_float("LR", 0, 0, 1, lo_open=True)
    with pytest.raises(validate.ParameterError, match=r"FRACTION .*\[0, 1\).*1"):
        validate.check_float("FRACTION", 1.0, 0, 1, hi_open=True)
    for bad in (math.nan, math.inf, "0.1", None):
        with pytest.raises(validate.ParameterError, match="LR"):
            validate.check_float("LR", bad, 0, 1)


def test_check_choice():
    assert validate.check_choice("OPTIMIZER", "adam", ["sgd", "adam"]) == "adam"
    with pytest.raises(validate.ParameterError, match=r"DEVICE must be one of \('auto', 'cpu', 'cuda'\), got 'tpu'"):
        validate.check_choice("DEVICE", "tpu", DEVICE_CHOICES)


def test_check_divides():
    validate.check_divides("N_EMBD", 128, "N_HEAD", 4)
    with pytest.raises(validate.ParameterError, match=r"N_EMBD \(130\) must be divisible by N_HEAD \(4\)"):
        validate.check_divides("N_EMBD", 130, "N_HEAD", 4)


def test_check_budget():
    assert validate.check_budget("BUDGET_BYTES", None) is None
    assert validate.check_budget("BUDGET_BYTES", 2.5e6) == 2_500_000
    for bad in (-1, 0, True, "1GB", math.nan):
        with pytest.raises(validate.ParameterError, match="BUDGET_BYTES must be None or a positive number"):
            validate.check_budget("BUDGET_BYTES", bad)


# -- devices -------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine 'auto' picks CUDA")
def test_resolve_device_on_cpu():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device='cuda:1'"):
        resolve_device("cuda:1")
    with pytest.raises(validate.ParameterError, match="DEVICE='cuda' but torch sees no CUDA device"):
        resolve_device("cuda", "DEVICE")


def test_resolve_device_rejects_unknown_naming_the_argument():
    with pytest.raises(ValueError) as info:
        resolve_device("tpu")
    assert str(info.value).startswith("device must be one of")
    assert all(choice in str(info.value) for choice in DEVICE_CHOICES)
    with pytest.raises(validate.ParameterError, match="^device must be one of"):
        resolve_device(0)
    with pytest.raises(validate.ParameterError, match=r"^DEVICE must be one of \('auto', 'cpu', 'cuda'\), got 'tpu'$"):
        resolve_device("tpu", "DEVICE")
    assert resolve_device("cpu", "DEVICE") == torch.device("cpu")


def test_hardware_report():
    text = hardware_report()
    assert f"torch {torch.__version__}" in text
    assert text.startswith(resolve_device("auto").type)


# -- throughput ----------------------------------------------------------------------------------

def test_measure_throughput_counts_and_rates():
    calls = []
    x = torch.randn(64, 64)

    def step():
        calls.append(1)
        (x @ x).sum()

    tp = measure_throughput(step, samples_per_step=8, tokens_per_step=256, warmup_steps=2, steps=5)
    assert len(calls) == 2 + 5
    assert tp.steps == 5 and len(tp.step_times_s) == 5
    assert all(t > 0 for t in tp.step_times_s)
    assert tp.step_s == pytest.approx(sorted(tp.step_times_s)[2])  # the median of five
    assert tp.samples_per_s == pytest.approx(8 / tp.step_s)
    assert tp.tokens_per_s == pytest.approx(256 / tp.step_s)
    assert measure_throughput(step, samples_per_step=1, steps=1).tokens_per_s is None
    with pytest.raises(ValueError, match="steps"):
        measure_throughput(step, samples_per_step=1, steps=0)


def test_measure_throughputs_interleaves_the_step_functions():
    order = []
    t = labkit.measure_throughputs({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                   samples_per_step=2, warmup_steps=1, steps=3)
    # one warm-up round, then three timed rounds, one step of each per round, each round starting one later
    assert order == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert set(t) == {"a", "b"} and t["a"].steps == t["b"].steps == 3
    assert t["a"].samples_per_s == pytest.approx(2 / t["a"].step_s)
    with pytest.raises(ValueError, match="step_fns"):
        labkit.measure_throughputs({}, samples_per_step=1)
    with pytest.raises(ValueError, match="warmup_steps"):
        labkit.measure_throughputs({"a": lambda: None}, samples_per_step=1, warmup_steps=-1)


def test_paired_ratio_divides_round_by_round_and_judges_agreement():
    def timed(times):
        return Throughput(sorted(times)[len(times) // 2], 1.0, None, len(times), tuple(times))

    t = {"this": timed((2.0, 6.0, 2.2, 2.4, 2.0)), "plain": timed((1.0, 1.0, 2.0, 1.2, 1.0))}
    r = paired_ratio(t, "this", "plain")
    assert r.round_ratios == (2.0, 6.0, 1.1, 2.0, 2.0) and r.rounds == 5
    assert r.median == 2.0  # the 6.0 round (a spike) does not move the median
    assert r.agrees(1.5)  # from five rounds the extremes (1.1 and 6.0) are left out: 2.0, 2.0, 2.0 agree
    assert not paired_ratio({"a": timed((1.0, 1.0, 2.0, 3.0, 3.0)), "b": timed((1.0,) * 5)}, "a", "b").agrees(1.5)
    three = paired_ratio({"a": timed((2.0, 2.0, 4.0)), "b": timed((1.0,) * 3)}, "a", "b")
    assert not three.agrees(1.5) and three.agrees(2.0)  # under five rounds every round counts
    assert not paired_ratio({"a": timed((2.0, 2.0)), "b": timed((1.0, 1.0))}, "a", "b").agrees(10.0)  # too few
    with pytest.raises(KeyError, match="'c' was not timed"):
        paired_ratio(t, "c", "plain")


def test_a_paired_ratio_says_slower_faster_not_told_apart_or_unreliable():
    from labkit.throughput import PairedRatio

    assert PairedRatio(2.0, (2.0, 6.0, 1.1, 2.0, 2.0)).verdict() == "slower"  # judged: 2.0, 2.0, 2.0
    assert PairedRatio(0.5, (0.5, 0.4, 0.6)).verdict() == "faster"
    assert PairedRatio(1.0, (0.9, 1.0, 1.1)).verdict() == "not told apart"  # on both sides of 1
    assert PairedRatio(1.1, (1.05, 1.1, 1.12)).verdict(noise=(0.95, 1.15)) == "not told apart"  # within the noise
    assert PairedRatio(1.1, (1.05, 1.1, 1.12)).verdict() == "slower"  # the same rounds, no noise band given
    assert PairedRatio(2.0, (1.0, 2.0, 4.0)).verdict() == "unreliable"  # they disagree
    assert PairedRatio(2.0, (2.0, 2.0)).verdict() == "unreliable"  # too few
    assert PairedRatio(2.0, (2.0, 6.0, 1.1, 2.0, 2.0)).words() == \
        "× 2.00 (the middle 3 of 5 rounds: 2.00–2.00): slower in each of them"
    assert PairedRatio(2.0, (2.0, 2.0)).words().endswith("(2 rounds: 2.00–2.00): too few rounds to tell")


def test_measure_throughput_refuses_inside_a_meter():
    calls = []
    with MemoryMeter(device="cpu"):
        with pytest.raises(RuntimeError, match="outside a MemoryMeter"):
            measure_throughput(lambda: calls.append(1), samples_per_step=1)
    assert calls == []


# -- widgets -------------------------------------------------------------------------------------

def test_control_panel_builds_controls_and_runs():
    import ipywidgets as W
    calls = []

    def experiment(layers, lr, optimizer, checkpoint, custom):
        calls.append((layers, lr, optimizer, checkpoint, custom))
        return layers * 10

    panel = control_panel(experiment, title="Try it", layers=(1, 8, 1), lr=(0.0, 1.0, 0.1, 0.3),
                          optimizer=["adam", "sgd"], checkpoint=False, custom=W.IntText(value=5))
    kinds = {name: type(w) for name, w in panel.controls.items()}
    assert kinds == {"layers": W.IntSlider, "lr": W.FloatSlider, "optimizer": W.Dropdown,
                     "checkpoint": W.Checkbox, "custom": W.IntText}
    c = panel.controls
    assert (c["layers"].min, c["layers"].max, c["layers"].step, c["layers"].value) == (1, 8, 1, 1)
    assert c["lr"].value == pytest.approx(0.3)
    assert list(c["optimizer"].options) == ["adam", "sgd"] and c["optimizer"].value == "adam"
    assert panel.run() == 10
    c["layers"].value, c["optimizer"].value, c["checkpoint"].value = 4, "sgd", True
    assert panel.run() == 40
    assert calls == [(1, pytest.approx(0.3), "adam", False, 5), (4, pytest.approx(0.3), "sgd", True, 5)]
    assert panel.status.value == "done" and panel.last_error is None
    sizes = control_panel(experiment, m=[8, 4, 2, 1], n=[1, 2, 4], o=["a"]).controls  # lists are options, any length
    assert type(sizes["m"]) is W.SelectionSlider and list(sizes["m"].options) == [8, 4, 2, 1] and sizes["m"].value == 8
    assert type(sizes["n"]) is W.SelectionSlider and type(sizes["o"]) is W.Dropdown
    with pytest.raises(TypeError, match="control 'bad'"):
        control_panel(experiment, bad=object())
    with pytest.raises(TypeError, match="callable"):
        control_panel("not a function")


def test_control_panel_shows_errors_instead_of_raising():
    def experiment(n):
        if n > 2:
            raise ZeroDivisionError("boom")
        return n

    panel = control_panel(experiment, n=(1, 5, 1))
    assert panel.run() == 1
    panel.controls["n"].value = 3
    assert panel.run() is None  # not the previous run's result
    assert "ZeroDivisionError" in panel.status.value
    assert isinstance(panel.last_error, ZeroDivisionError)
    assert not panel.button.disabled
    panel.controls["n"].value = 2
    assert panel.run() == 2 and panel.last_error is None


def test_control_panel_reports_out_of_memory():
    def experiment(kib):
        with MemoryMeter(device="cpu", budget_bytes=64 * 1024) as meter:
            x = torch.empty(kib * 256)  # kib KiB of float32
            return meter.peak_bytes + 0 * x.numel()

    panel = control_panel(experiment, kib=(1, 128, 1, 16))
    assert panel.run() == 16 * 1024
    panel.controls["kib"].value = 100
    assert panel.run() is None
    assert "does not fit" in panel.status.value
    assert isinstance(panel.last_error, OutOfMemory)
    assert panel.last_error.requested_bytes == 100 * 1024
    assert panel.last_error.__traceback__ is None  # the frames (and their tensors) are let go

    def cuda_oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    panel = control_panel(cuda_oom)
    panel.run()
    assert "does not fit" in panel.status.value
    assert panel.last_error.__traceback__ is None


# -- plots ---------------------------------------------------------------------------------------

def _small_step():
    cfg = labkit.MLPConfig(in_features=8, hidden=16, depth=2, classes=3)
    torch.manual_seed(0)
    model = labkit.build_model(cfg)
    opt = labkit.make_optimizer("adam", model.parameters())
    return labkit.measure_step(model, opt, labkit.example_batch(cfg, 4), budget_bytes=10**6)


def test_plot_timeline():
    step = _small_step()
    ax = plot_timeline(step.meter)
    phases = {p.phase for p in step.meter.timeline}
    assert len(ax.lines) == 2  # the memory line and the budget line (the meter's budget)
    assert ax.lines[1].get_ydata()[0] == pytest.approx(10**6 / MiB)
    assert len(ax.collections) == len(phases)  # one scatter per phase present
    y = ax.lines[0].get_ydata()
    assert len(y) == len(step.meter.timeline)
    assert max(y) == pytest.approx(step.peak_bytes / MiB)
    assert png_bytes(ax.figure).startswith(PNG_SIGNATURE)
    # A plain list of points and no budget: one line.
    points = [TimelinePoint(i, 0.0, b, "forward") for i, b in enumerate([0, MiB, 3 * MiB, 2 * MiB])]
    ax = plot_timeline(points)
    assert len(ax.lines) == 1 and list(ax.lines[0].get_ydata()) == [0, 1, 3, 2]
    assert len(ax.collections) == 1
    ax = plot_timeline([])
    assert len(ax.lines) == 0 and ax.texts[0].get_text() == "no allocations recorded"


def test_plot_memory_bars():
    splits = {
        "plain": {"parameters": 4 * MiB, "gradients": 4 * MiB, "optimizer_state": 8 * MiB, "activations": 20 * MiB},
        "checkpointed": {"parameters": 4 * MiB, "gradients": 4 * MiB, "optimizer_state": 8 * MiB,
                         "activations": 6 * MiB},
        "no state": {"parameters": 4 * MiB},
    }
    ax = plot_memory_bars(splits, budget_bytes=30 * MiB)
    assert len(ax.containers) == len(labkit.CATEGORIES)  # one stacked layer per category
    assert all(len(c) == 3 for c in ax.containers)  # one bar per label
    assert len(ax.patches) == 4 * 3
    tops = [max(bar.get_y() + bar.get_height() for bar in (c[i] for c in ax.containers)) for i in range(3)]
    assert tops == pytest.approx([36, 22, 4])
    assert len(ax.lines) == 1 and ax.lines[0].get_ydata()[0] == pytest.approx(30)
    assert png_bytes(ax.figure).startswith(PNG_SIGNATURE)


def test_live_figure_redraws():
    seen = []

    def draw(fig, axes, data):
        seen.append(len(data))
        plot_series(axes[0], range(len(data)), {"loss": data}, "step", "loss")
        plot_series(axes[1], range(len(data)), {"a": data, "b": [2 * v for v in data]}, "step", "x", logx=True)

    live = LiveFigure(draw, ncols=2)
    assert live.fig is None
    fig1 = live.update([3.0, 2.0])
    fig2 = live.update([3.0, 2.0, 1.5])
    assert seen == [2, 3]
    assert fig2 is live.fig and fig1 is not fig2
    assert len(fig2.axes) == 2
    assert [len(ax.lines) for ax in fig2.axes] == [1, 2]
    assert list(fig2.axes[0].lines[0].get_ydata()) == [3.0, 2.0, 1.5]
    assert fig2.axes[1].get_xscale() == "log"
    assert png_bytes(fig2).startswith(PNG_SIGNATURE)


def test_new_figure_takes_rows_first_like_matplotlib():
    from labkit.plots import new_figure

    fig, axes = new_figure(2, 3, width_in=2.0, height_in=1.0)
    assert axes.shape == (2, 3)
    assert tuple(fig.get_size_inches()) == pytest.approx((6.0, 2.0))  # 3 columns of 2 in, 2 rows of 1 in
    assert new_figure(ncols=2)[1].shape == (2,)


def test_in_kernel_is_false_outside_jupyter():
    assert labkit.in_kernel() is False


# -- the running example -------------------------------------------------------------------------

def test_tiny_running_example_gets_a_kib_budget():
    ex = labkit.running_example(n_layer=1, n_embd=8, n_head=8, batch_size=2, seq_len=2)
    assert ex.baseline_peak_bytes < 2**20  # a whole-MiB budget would round to 0
    assert ex.budget_bytes % 2**10 == 0
    assert ex.budget_bytes <= 0.75 * ex.baseline_peak_bytes < ex.budget_bytes + 2**10


def test_running_example_counts_its_peak_once_and_only_when_asked(monkeypatch):
    from labkit import example
    calls = []
    real = example.estimate_training_memory
    monkeypatch.setattr(example, "estimate_training_memory", lambda *a, **k: calls.append(a) or real(*a, **k))
    ex = labkit.running_example(n_layer=1, n_embd=32, n_head=2, batch_size=2, seq_len=8)
    assert ex.config.n_layer == 1 and calls == []  # a distributed rank that only builds the model counts nothing
    assert 0 < ex.budget_bytes < ex.baseline_peak_bytes and len(calls) == 1  # counted once, for both
    given = labkit.running_example(n_layer=1, n_embd=32, n_head=2, batch_size=2, seq_len=8, budget_bytes=3 << 20)
    assert given.budget_bytes == 3 << 20 and len(calls) == 1  # a budget given is not computed
    with pytest.raises(labkit.ParameterError, match="budget_bytes"):
        labkit.running_example(budget_bytes=0)


def test_running_example_does_not_fit_its_budget():
    ex = labkit.running_example()
    assert 0 < ex.budget_bytes < ex.baseline_peak_bytes
    assert ex.budget_bytes % 2**20 == 0
    # The budget is the largest whole MiB at or below 3/4 of the peak.
    assert ex.budget_bytes <= 0.75 * ex.baseline_peak_bytes < ex.budget_bytes + 2**20
    assert ex.config.block_size >= ex.seq_len

    torch.manual_seed(0)
    model = labkit.build_model(ex.config)
    opt = labkit.make_optimizer("adam", model.parameters())
    batch = labkit.example_batch(ex.config, ex.batch_size, ex.seq_len)
    real = labkit.measure_step(model, opt, batch)
    assert real.peak_bytes == ex.baseline_peak_bytes  # the estimate is the real count
    assert real.split["parameters"] == 4 * ex.config.n_params()

    res = labkit.try_fit(labkit.measure_step, model, opt, batch, budget_bytes=ex.budget_bytes, warmup=False)
    assert not res.fits
    assert isinstance(res.error, OutOfMemory)
    assert res.error.budget_bytes == ex.budget_bytes
    assert res.error.in_use_bytes + res.error.requested_bytes > ex.budget_bytes >= res.error.in_use_bytes


# -- the step core: optimizer state without a forward, a timed call --------------------------------------
def test_create_optimizer_state_makes_adams_state_and_leaves_no_gradient():
    from labkit.train import create_optimizer_state, make_optimizer

    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    opt = make_optimizer("adam", model.parameters())
    create_optimizer_state(opt)
    assert all(set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # a zero gradient moves no weight


def test_create_optimizer_state_makes_no_update_for_adamw_and_one_for_other_optimizers():
    """AdamW's state comes from its own _init_group (its weight decay moves no weight); SGD's momentum buffer from one
    foreach update of zero gradients, its foreach setting restored afterwards."""
    from labkit.train import create_optimizer_state

    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    create_optimizer_state(adamw)
    assert all(set(adamw.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in model.parameters())
    assert all(float(adamw.state[p]["step"]) == 0 and not adamw.state[p]["exp_avg"].any() for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no decay: no update ran
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    create_optimizer_state(sgd)
    assert all(set(sgd.state[p]) == {"momentum_buffer"} for p in model.parameters())
    assert sgd.param_groups[0]["foreach"] is False and all(p.grad is None for p in model.parameters())


def test_seeded_model_builds_the_same_weights_as_seeding_by_hand():
    from labkit.models import GPTConfig, MLPConfig
    from labkit.train import seeded_model

    for config in (GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32), MLPConfig(depth=2)):
        torch.manual_seed(3)
        by_hand = labkit.build_model(config)
        after_hand = torch.rand(1)
        model = seeded_model(config, 3)
        assert torch.equal(torch.rand(1), after_hand)  # the global generator left where building by hand leaves it
        assert type(model) is type(by_hand) and next(model.parameters()).device.type == "cpu"
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), by_hand.state_dict().values()))
        other = seeded_model(config, 4)
        assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_fastest_s_warms_up_once_then_keeps_the_fastest_of_its_repeats():
    from labkit.throughput import fastest_s, timed_call

    import time

    calls = []
    pauses = iter([0.3, 0.15, 0.001, 0.1])  # a warm-up, then three timed calls: the fastest sleeps 1 ms

    def fn():
        calls.append(1)
        time.sleep(next(pauses))

    best = fastest_s(fn, 3, "cpu")
    assert len(calls) == 4 and 0.001 <= best < 0.1  # a sleep never returns early: only the 1 ms call is below 0.1 s
    assert timed_call(lambda: None, "cpu") >= 0
    with pytest.raises(validate.ParameterError, match="repeats"):
        fastest_s(fn, 0)
