"""The closing page (notebook 10) and labkit.tools.closing: figures read from results.json, the order computed from them.

The page's figures in the tests come from tests/data/closing_results.json: a real `make run`'s results.json cut to
the records the page reads (`workbook.closingfixture`; its `note` says so and the page prints it). No chapter runs
for these tests. `make test` points nbval's run of the page at the same file ($LABKIT_RESULTS, Makefile).
To renew it after a `make run`: `.venv/bin/python -m workbook.closingfixture build/results.json`.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest

from labkit import gpus
from labkit.costs import work_from_record, work_record
from labkit.meter import format_bytes
from labkit.tools import closing

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "closing_results.json"
PAGE = "10_what_to_use_when"


@pytest.fixture
def results() -> dict:
    return json.loads(FIXTURE.read_text())


def test_the_fixture_is_complete_and_says_where_it_comes_from(results):
    assert closing.missing(results) == {}
    assert "make run" in results["note"] and results["generated_utc"] and results["hardware"]


def test_the_fixture_is_what_its_renewal_writes(results, tmp_path):
    """workbook.closingfixture cuts a results.json to the page's records: the committed fixture is its own cut."""
    from workbook import closingfixture
    full = copy.deepcopy(results)
    full["notebooks"]["00_where_the_memory_goes"]["measurements"]["not_read_by_the_page"] = 1
    full["notebooks"]["99_not_a_chapter"] = {"status": "ok", "measurements": {"x": 1}}
    src, out = tmp_path / "results.json", tmp_path / "fixture.json"
    src.write_text(json.dumps(full))
    assert closingfixture.main([str(src), "--out", str(out)]) == 0
    assert out.read_text() == FIXTURE.read_text()  # byte for byte: what the page does not read is cut


def test_every_record_the_page_reads_is_recorded_by_its_chapter():
    for stem, keys in closing.SOURCES.items():
        source = (ROOT / "notebooks" / f"{stem}.ipynb").read_text()
        for key in keys:
            assert re.search(rf'record\(\\?"{key}\\?"', source), f"{stem} does not record {key}: update closing.SOURCES"


def test_missing_results_and_missing_chapters_are_named_with_the_command(results):
    gaps = closing.missing(None)
    assert set(gaps) == set(closing.SOURCES) and set(gaps.values()) == {"not run"}
    partial = copy.deepcopy(results)
    del partial["notebooks"]["06b_pipeline_parallel"]
    partial["notebooks"]["03_mixed_precision"]["status"] = "failed"
    del partial["notebooks"]["05_layer_to_layer"]["measurements"]["l2l_peak_bytes"]
    gaps = closing.missing(partial)
    assert gaps == {"03_mixed_precision": "its last run failed", "05_layer_to_layer": "did not record l2l_peak_bytes",
                    "06b_pipeline_parallel": "not run"}
    line = closing.run_first(gaps)
    assert "--only 03 --only 05 --only 06b" in line and "make run" in line
    assert closing.missing(partial, closing.SEARCH) == {}


def _projected(m: dict, before: str, after: str, gpu: str) -> float:
    return (gpus.step_time(work_from_record(m[after]), gpu).time_s
            / gpus.step_time(work_from_record(m[before]), gpu).time_s)


def test_rows_are_the_chapters_figures_and_their_work_on_the_gpu(results):
    rows = {r["chapter"]: r for r in closing.one_device_rows(results, "t4")}
    m = results["notebooks"]["04_activation_offload"]["measurements"]
    assert rows["04"]["saved"] == m["baseline_peak_bytes"] - m["device_peak_bytes_offload"]
    assert rows["04"]["time_ratio"] == _projected(m, "work_baseline", "work_offload", "t4")
    mp = results["notebooks"]["03_mixed_precision"]["measurements"]
    # a T4 has no bf16 units: the row is the step it runs, fp16 with a GradScaler, whose work chapter 03 counted
    assert rows["03"]["time_ratio"] == _projected(mp, "work_fp32", "work_fp16_scaled", "t4") < 1  # 16 bits save time
    assert rows["03"]["technique"] == "fp16 autocast + GradScaler"
    a100 = next(r for r in closing.one_device_rows(results, "a100-80gb") if r["chapter"] == "03")  # bf16 units
    assert a100["technique"] == f"{mp['half_precision']} autocast"
    assert a100["time_ratio"] == _projected(mp, "work_fp32", "work_half", "a100-80gb")
    acc = results["notebooks"]["01_gradient_accumulation"]["measurements"]
    k = acc["fitting_accum_steps"]
    assert rows["01"]["time_ratio"] == _projected(acc["work_by_accum_steps"], "1", str(k), "t4") >= 1
    assert rows["04"]["fits"] == (m["device_peak_bytes_offload"] <= closing.budget_bytes(results))
    assert all(r["timing"] == "counted work on the t4 (the roofline, a bound)" for r in rows.values())


def test_16_bit_autocast_comes_first_on_the_t4_and_the_a100_and_its_gpu_peak_says_whether_it_fits(results):
    # issue 36's acceptance: the one-device order is the GPU's, where 16-bit autocast saves time as well as memory.
    # Its peak is the step a GPU runs (chapter 03 records CUDA autocast's dtypes): on the running example it does not
    # fit alone, as the H200's run of chapter 03 measured, so the sentence names the first that does
    mp = results["notebooks"]["03_mixed_precision"]["measurements"]
    assert mp["peak_bytes_half"] > closing.budget_bytes(results)
    for gpu, technique in (("t4", "fp16 autocast + GradScaler"), ("a100-80gb", "bf16 autocast")):
        order = closing.cost_order(closing.one_device_rows(results, gpu))
        assert order[0]["technique"] == technique and order[0]["after"] == mp["peak_bytes_half"], (gpu, order[0])
        assert not order[0]["fits"]
        fit = next(r for r in order if r["fits"])
        sentence = closing.order_sentence(order)
        assert sentence.startswith(f"On this run {technique} comes first"), sentence
        assert f"the first in the order that fits the budget alone is {fit['technique']}" in sentence, sentence
    # a CPU without bf16 units (the reference AVX2 CPU: bf16 matmuls 52x slower than fp32) ranks it last; the profile
    # is built, not measured: a CPU with AMX (CI's) times bf16 faster than fp32 and would rank it otherwise
    avx2 = gpus.DeviceProfile("cpu", 24 * 2**30, {"fp32": 1e11, "bf16": 1e11 / 52}, *(2e10,) * 4)
    assert closing.cost_order(closing.one_device_rows(results, avx2))[-1]["chapter"] == "03"


def _with_launches(m: dict, before: str, after: str, gpu: str) -> tuple[float, bool]:
    b, a = (gpus.step_time(work_from_record(m[k]), gpu) for k in (before, after))
    return a.with_launches_s / b.with_launches_s, a.launch_bound or b.launch_bound


def test_each_row_carries_its_ratio_with_the_hosts_launches_and_says_when_they_set_the_pace(results):
    rows = {r["chapter"]: r for r in closing.one_device_rows(results, "t4")}
    mp = results["notebooks"]["03_mixed_precision"]["measurements"]
    ratio, bound = _with_launches(mp, "work_fp32", "work_fp16_scaled", "t4")
    assert rows["03"]["time_ratio_launches"] == ratio and rows["03"]["launch_bound"] == bound
    acc = results["notebooks"]["01_gradient_accumulation"]["measurements"]
    ratio, bound = _with_launches(acc["work_by_accum_steps"], "1", str(acc["fitting_accum_steps"]), "t4")
    assert rows["01"]["time_ratio_launches"] == ratio and rows["01"]["launch_bound"] == bound
    for r in rows.values():  # a launch-bound row's line gives both figures; one set by its work gives one
        line = closing.order_line(1, r, [r])
        assert (f"with the host's launches {r['time_ratio_launches']:.2f}x" in line) == r["launch_bound"], line
    cpu = closing.one_device_rows(results, "cpu")  # a CPU runs what it dispatches: no launches, one figure
    assert not any(r["launch_bound"] for r in cpu)
    assert all(r["time_ratio_launches"] == pytest.approx(r["time_ratio"]) for r in cpu)


def test_another_gpu_moves_the_times_not_the_memory(results):
    t4, h100 = ({r["chapter"]: r for r in closing.one_device_rows(results, g)} for g in ("t4", "h100"))
    assert all(t4[c]["saved"] == h100[c]["saved"] and t4[c]["fits"] == h100[c]["fits"] for c in t4)
    assert t4["04"]["time_ratio"] > h100["04"]["time_ratio"]  # PCIe 3 against PCIe 5: offload's copies cost less
    assert "an estimate" in h100["01"]["timing"]  # a published run gives the H100's share of peak


def _set_cost(results, chapter_stem, key, value):
    results["notebooks"][chapter_stem]["measurements"][key] = value


def _set_time_ratio(results: dict, chapter: str, ratio: float) -> dict:
    """Return a copy of results where chapter's technique takes `ratio` x the plain step's time on any GPU: its work
    is the plain step's, every count scaled by `ratio` (the roofline is linear in the counts)."""
    results = copy.deepcopy(results)
    stem = next(s for s in closing.SOURCES if s.startswith(chapter))
    m = results["notebooks"][stem]["measurements"]
    if chapter == "01":
        works = m["work_by_accum_steps"]
        plain = work_from_record(works["1"])
        m["work_by_accum_steps"] = {k: w if int(k) == 1 else work_record(plain * ratio) for k, w in works.items()}
        return results
    before, after = {"02": ("work_plain", "work_every_block"), "03": ("work_fp32", "work_fp16_scaled"),
                     "04": ("work_baseline", "work_offload"), "05": ("work_plain", "work_l2l")}[chapter]
    m[after] = work_record(work_from_record(m[before]) * ratio)
    return results


def test_the_order_and_its_sentence_change_with_the_figures(results):
    rows = closing.cost_order(closing.one_device_rows(results))
    order, sentence = [r["technique"] for r in rows], closing.order_sentence(rows)
    first, last = rows[0], rows[-1]
    # the first technique made ten times slower goes to the end, and the sentence names the next
    slow = closing.cost_order(closing.one_device_rows(_set_time_ratio(results, first["chapter"], 10.0)))
    assert [r["technique"] for r in slow] == order[1:] + order[:1]
    assert closing.order_sentence(slow) != sentence
    assert closing.order_sentence(slow).startswith(f"On this run {order[1]} comes first")
    # the last ranked one made free (the plain step's time) moves ahead of every technique that costs time
    free = closing.cost_order(closing.one_device_rows(_set_time_ratio(results, last["chapter"], 1.0)))
    names = [r["technique"] for r in free]
    paying = [r["technique"] for r in rows if closing.cost_per_mib(r) > 0 and r is not last]
    assert names != order and all(names.index(last["technique"]) < names.index(p) for p in paying), names
    # made faster than every other, it comes first
    fast = closing.cost_order(closing.one_device_rows(_set_time_ratio(results, last["chapter"], 0.01)))
    assert fast[0]["technique"] == last["technique"]
    assert "saves memory and its counted work projects a shorter step" in closing.order_sentence(fast)


def test_close_costs_are_tied_and_time_savers_go_first_by_time_saved(results):
    tweaked = _set_time_ratio(_set_time_ratio(results, "04", 1.30), "05", 1.36)
    rows = closing.cost_order(closing.one_device_rows(tweaked), 0.05)
    by_ch = {r["chapter"]: r for r in rows}
    assert closing.tied(by_ch["04"], by_ch["05"], 0.05) and not closing.tied(by_ch["04"], by_ch["05"], 0.0)
    line = closing.order_line(rows.index(by_ch["05"]) + 1, by_ch["05"], rows, 0.05)
    assert f"tied with place {rows.index(by_ch['04']) + 1} within the tolerance" in line
    # two techniques that save time: the one that saves more time first, whatever memory each saves
    both = _set_time_ratio(_set_time_ratio(results, "04", 0.9), "03", 0.6)
    rows = closing.cost_order(closing.one_device_rows(both), 0.05)
    assert [r["chapter"] for r in rows[:2]] == ["03", "04"]


def test_the_with_launches_order_ranks_by_the_launches_ratio_and_marks_ties(results):
    rows = closing.one_device_rows(results, "t4")
    by_work, by_launches = closing.cost_order(rows), closing.with_launches_order(rows)
    assert {r["technique"] for r in by_launches} == {r["technique"] for r in rows}
    swapped = [dict(r, time_ratio=r["time_ratio_launches"], time_ratio_launches=r["time_ratio"]) for r in rows]
    assert [r["technique"] for r in closing.with_launches_order(swapped)] == [r["technique"] for r in by_work]
    text = closing.chapters_in_order(by_launches)
    assert re.split(" ≈ |, ", text) == [r["chapter"] for r in by_launches]
    assert text.count("≈") == sum(closing.tied(a, b) for a, b in zip(by_launches, by_launches[1:]))
    assert closing.chapters_in_order(by_launches, 0.0).count("≈") == 0 and closing.chapters_in_order([]) == ""


def test_tied_neighbours_share_a_place_as_the_order_prints_them(results):
    by_launches = closing.with_launches_order(closing.one_device_rows(results, "t4"))
    places = closing.places(by_launches)
    runs = closing.chapters_in_order(by_launches).split(", ")  # each run of tied neighbours: "a ≈ b ≈ c"
    place = 1
    for run in runs:
        chapters = run.split(" ≈ ")
        got = [places[r["technique"]] for r in by_launches[place - 1:place - 1 + len(chapters)]]
        assert got == ([f"{place}="] * len(chapters) if len(chapters) > 1 else [str(place)]), run
        place += len(chapters)
    untied = closing.places(by_launches, 0.0)
    assert sorted(untied.values(), key=int) == [str(i) for i in range(1, len(by_launches) + 1)]
    assert closing.places([]) == {}


def test_the_fit_sentence_stops_only_where_the_headroom_covers_the_planners_reserve(results, monkeypatch):
    order = closing.cost_order(closing.one_device_rows(results))
    fit = next(r for r in order if r["fits"])
    share = fit["headroom"] / (fit["after"] + fit["headroom"])
    for reserve in (share / 2, share * 2):  # the headroom covers the reserve, then it does not
        monkeypatch.setattr(closing, "RESERVE_FRACTION", reserve)
        sentence = closing.order_sentence(order)
        assert format_bytes(fit["headroom"]) in sentence and f"the {reserve:.0%} chapter 09's planner" in sentence
        covers = reserve <= share
        assert ("at least the" in sentence) == covers and ("add the next technique" in sentence) == (not covers)
        assert ("stop there" in sentence) == (covers and fit is order[0])


def test_the_search_lines_call_a_chapter_with_the_chosen_setting_the_same_setting(results):
    chosen = closing.search_figures(results)
    assert chosen["speed_on"].startswith("projected") and chosen["noise"] == 0  # the fixture's run: on a CPU
    lines = closing.search_lines(chosen)
    assert sum(line.endswith(": the same setting") for line in lines) == len(chosen["same"])
    for name, launches in chosen["ratios_launches"].items():  # chapter 08's with-launches ratio beside the work's
        assert name in chosen["same"] or any(line.startswith(f"  against {name}: projected {chosen['ratios'][name]:.2f}x "
                                                             f"as fast by the work, {launches:.2f}x with the host's "
                                                             "launches") for line in lines), lines
    assert chosen["ratios_launches"], "the fixture's chapter 08 recorded no with-launches ratios"
    changed = copy.deepcopy(results)  # a run on CUDA: timed, with a noise band the copies of one setting widen
    m = changed["notebooks"]["08_memory_aware_search"]["measurements"]
    name = next(n for n in m["fastest_vs_chapters_speed_ratio"] if n not in m["chapters_with_fastest_setting"])
    m["chapters_with_fastest_setting"], m["fastest_vs_chapters_speed_ratio"][name] = [name], 1.3
    m["timing_noise_ratio"], m["speed_on"] = 1.05, "measured on this GPU"
    chosen = closing.search_figures(changed)
    assert chosen["noise"] == pytest.approx(0.3)
    assert any(line.startswith(f"  against {name}: the same setting (timed 1.30x apart") for line in closing.search_lines(chosen))


def test_the_several_device_lines_print_every_bubble_and_say_a_tie(results):
    f = closing.several_device_figures(results)
    text = "\n".join(closing.several_device_lines(f, 8))
    for schedule, bubble in f["bubble_by_microbatches"].items():
        for m, b in bubble.items():
            assert f"M={m}: {b:.3f}" in text
    assert "with its share of the batch" in text
    comm, chosen, pays = f["comm_bytes"], f["use_when"]["whole_budget"], f["pays"]
    tied = [p for p, v in f["points"].items() if v.get("whole budget") and p != chosen and comm[p] == comm[chosen]
            and pays.get(p) == pays.get(chosen)]
    assert ("ties for the fewest" in text) == bool(tied)
    sentence = next(line for line in text.split("\n") if line.startswith("a few GPUs"))
    for p in pays:  # a point that pays in precision or recomputation never ties with one that pays nothing
        if p != chosen and pays[p] != pays.get(chosen):
            assert p not in sentence.split("ties for the fewest")[-1].split(";")[0]


def test_ddps_peak_per_rank_agrees_with_chapter_07s_verdicts_and_is_printed(results):
    f = closing.several_device_figures(results)
    ddp = f["points"]["DDP"]
    assert (f["ddp_peak"] <= f["budget"]) == ddp["whole budget"]
    assert (f["ddp_peak"] <= f["rank_budget"]) == next(v for k, v in ddp.items() if k != "whole budget")
    assert f"DDP's peak per rank ({format_bytes(f['ddp_peak'])}) fits" in closing.several_device_lines(f, 8)[0]
    sh = copy.deepcopy(results["notebooks"]["07_sharded_data_parallel"]["measurements"])
    sh["comm_bytes_by_collective_by_stage"]["DDP"]["all_reduce"]["input_bytes"] *= 2  # twice the parameters
    assert closing.ddp_peak_bytes(sh) == pytest.approx(2 * f["ddp_peak"])


def test_the_few_gpu_line_says_to_follow_chapter_07s_pick_where_it_is_not_ddp_and_why(results):
    f = closing.several_device_figures(results)
    follows = "follow chapter 07's pick" in closing.several_device_lines(f, 8)[0]
    assert follows == (f["use_when"]["whole_budget"] != "DDP")  # the fixture's own pick: DDP, or said to be followed
    ddp = copy.deepcopy(results)
    ddp["notebooks"]["07_sharded_data_parallel"]["measurements"]["use_when"]["whole_budget"] = "DDP"
    assert "follow chapter 07's pick" not in closing.several_device_lines(closing.several_device_figures(ddp), 8)[0]
    picked = copy.deepcopy(results)
    sh = picked["notebooks"]["07_sharded_data_parallel"]["measurements"]
    sh["use_when"]["whole_budget"] = "FSDP2 no-reshard"  # as many bytes as DDP, a lower peak (its Adam state sharded)
    g = closing.several_device_figures(picked)
    assert g["pick_peak"] == closing.point_peak_bytes(sh, "FSDP2 no-reshard") < g["ddp_peak"]
    line = closing.several_device_lines(g, 8)[0]
    assert (f"follow chapter 07's pick on this run: FSDP2 no-reshard sends as many bytes per rank as DDP and peaks at "
            f"{format_bytes(g['pick_peak'])} per rank against DDP's {format_bytes(g['ddp_peak'])}") in line
    assert line.endswith("here it buys room at no extra bytes.")
    assert closing.point_peak_bytes(sh, "DDP bucket view") is None  # no peak per parameter recorded for it


def test_the_bubbles_trend_is_chapter_06bs_verdict_by_its_timed_steps(results):
    f = closing.several_device_figures(results)
    pp = results["notebooks"]["06b_pipeline_parallel"]["measurements"]
    assert f["bubble_trend"] == pp["bubble_trend_by_schedule"] and set(f["bubble_trend"]) == set(f["bubble_by_microbatches"])
    rising = {"GPipe": {1: 0.5, 4: 0.3, 16: 0.4}}  # medians that fall to M = 4, then rise
    for verdict in ("falls from 0.500 at M = 1 to level within the timed steps' spread (0.280-0.420) from M = 4 to "
                    "M = 16", "falls from 0.500 at M = 1 to its lowest, 0.300 at M = 4, then rises to 0.400 at M = 16"):
        changed = dict(f, bubble_by_microbatches=rising, bubble_theory={}, bubble_trend={"GPipe": verdict})
        text = "\n".join(closing.several_device_lines(changed, 8))
        assert f"GPipe: M=1: 0.500, M=4: 0.300, M=16: 0.400; chapter 06b's verdict, by its timed steps' spread: it {verdict}" in text


def test_the_sentence_says_when_nothing_fits_alone(results):
    changed = copy.deepcopy(results)
    _set_cost(changed, "00_where_the_memory_goes", "budget_bytes", 1)
    rows = closing.cost_order(closing.one_device_rows(changed))
    assert not any(r["fits"] for r in rows)
    assert "none fits the budget alone" in closing.order_sentence(rows)


def _outputs(path) -> str:
    nb = json.loads(Path(path).read_text())
    return "\n".join("".join(o.get("text") or o.get("data", {}).get("text/plain", ""))
                     for c in nb["cells"] for o in c.get("outputs", []))


def test_the_page_prints_the_order_from_the_fixture_and_names_what_is_missing(execute_notebook, results, tmp_path):
    # one run, without chapter 06b's figures: the one-device order still prints, the several-device part says what
    # is missing (nbval runs the page on the whole fixture)
    partial = copy.deepcopy(results)
    del partial["notebooks"]["06b_pipeline_parallel"]
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    entry = execute_notebook(PAGE, RESULTS=str(tmp_path / "partial.json"), timeout_s=120)
    assert entry["status"] == "ok", entry.get("error")
    text = _outputs(entry["path"])
    order = closing.cost_order(closing.one_device_rows(results))
    assert closing.order_sentence(order) in text  # the one-device part does not need 06
    assert f"1. {order[0]['technique']}" in text and results["note"] in text
    assert entry["measurements"]["order_one_device"] == [r["technique"] for r in order]
    assert entry["figure_problems"] == [], entry["figure_problems"]  # the page's own figures pass the check
    assert "run these chapters first: 06b_pipeline_parallel (not run)" in text
    assert "skipped: needs the figures of chapter 06b" in text


def test_the_side_by_side_line_names_pairs_the_separate_timings_order_the_other_way(results):
    rows = closing.one_device_rows(_set_time_ratio(_set_time_ratio(results, "02", 1.2), "05", 1.4))
    chosen = closing.search_figures(results)
    names = {n[:2]: n for n in chosen["ratios"]}
    chosen["noise"] = 0.01
    chosen["ratios"][names["02"]], chosen["ratios"][names["05"]] = 3.0, 2.0  # 05 faster side by side, 02 apart
    line = closing.side_by_side_line(rows, chosen)
    assert "02 and 05" in line and "the other way round" in line
    chosen["ratios"][names["02"]] = 2.01  # within the noise band: not a disagreement
    assert "02 and 05" not in closing.side_by_side_line(rows, chosen)


def test_the_recorded_gpu_runs_steps_beside_their_roofline_and_their_launches():
    """Chapter 10's 'Measured on a GPU': the H200 run's measured ratios, each beside the two counted predictions."""
    import json

    from labkit.gpus import GPU_RUN_PATH

    run = json.loads(GPU_RUN_PATH.read_text())
    rows = {r["technique"]: r for r in closing.gpu_run_rows(run)}
    assert list(rows) == ["accumulation k=2", "accumulation k=4", "accumulation k=8", "bf16 autocast",
                          "layer-to-layer"]
    k8 = rows["accumulation k=8"]
    m1 = run["notebooks"]["01_gradient_accumulation"]["measurements"]
    assert k8["measured"] == m1["step_time_ratio_by_accum_steps"]["8"]
    works = {k: work_from_record(m1["work_by_accum_steps"][k]) for k in ("1", "8")}
    h200 = gpus.step_time(works["1"], "h200"), gpus.step_time(works["8"], "h200")
    assert all(t.launch_bound for t in h200)  # the host's launches set both steps' pace: their operators' ratio
    assert k8["launches"] == h200[1].with_launches_s / h200[0].with_launches_s == pytest.approx(
        works["8"].kernels / works["1"].kernels)
    m3 = run["notebooks"]["03_mixed_precision"]["measurements"]
    half = rows["bf16 autocast"]  # a speed ratio in the record, a time ratio here
    assert half["measured"] == 1 / m3["throughput_ratio_half"]
    assert half["roofline"] == m3["gpu_step_time_ratio_half"]  # by the work alone
    assert half["launches"] == pytest.approx(_with_launches(m3, "work_fp32", "work_half", "h200")[0])
    recorded = copy.deepcopy(run)  # a run that recorded chapter 03's with-launches ratio: the page reads it
    recorded["notebooks"]["03_mixed_precision"]["measurements"]["gpu_step_time_ratio_half_launches"] = 1.5
    assert next(r for r in closing.gpu_run_rows(recorded) if r["technique"] == "bf16 autocast")["launches"] == 1.5
    for r in rows.values():  # the named prediction is within NEAR of the measurement and the nearer one; else neither
        off = {k: max(r[k], r["measured"]) / min(r[k], r["measured"]) for k in ("launches", "roofline")}
        if r["nearer"] == "neither":
            assert min(off.values()) > closing.NEAR
        else:
            assert off[r["nearer"]] <= closing.NEAR and off[r["nearer"]] == min(off.values())
    # what the record says: k=2 and bf16 follow their launches; k=4 and k=8 take longer than their operators' launches
    # (1.3-1.4x more: a cost per micro-step the per-operator figure leaves out), layer-to-layer's copies likewise
    assert [r["nearer"] for r in rows.values()] == ["launches", "neither", "neither", "launches", "neither"]
    assert all(r["measured"] > r["launches"] for n, r in rows.items() if n != "bf16 autocast")  # low where it misses
    lines = closing.gpu_run_lines(run, list(rows.values()))
    assert "NVIDIA H200" in lines[0] and len(lines) == 2 + len(rows)


def test_the_measured_run_is_this_pages_only_when_it_timed_chapters_01_03_05_on_the_gpu_it_projected_onto(results):
    """Chapter 10's 'Measured on a GPU' reads the page's own results.json only when its chapters ran on a CUDA device
    and projected onto that GPU; otherwise (a CPU run, a chapter missing, another GPU projected) the recorded run."""
    from labkit.gpus import GPU_RUN_PATH

    recorded = json.loads(GPU_RUN_PATH.read_text())
    assert closing.cuda_gpu_key(recorded["hardware"]) == "h200"
    assert closing.cuda_gpu_key("cuda: NVIDIA A100-SXM4-80GB, 79.3 GiB") == "a100-80gb"  # not the A10's "A10"
    assert closing.cuda_gpu_key(results["hardware"]) is None  # the fixture ran on a CPU
    assert closing.timed_on_its_gpu(recorded) and not closing.timed_on_its_gpu(results)
    assert not closing.timed_on_its_gpu(None)
    assert closing.measured_run(results) == (recorded, f"labkit/data/{GPU_RUN_PATH.name}")
    assert closing.measured_run(recorded) == (recorded, "this page's results.json, named above")
    other = copy.deepcopy(recorded)
    other["notebooks"]["03_mixed_precision"]["measurements"]["gpu"] = "t4"  # timed on the H200, projected on a T4
    assert not closing.timed_on_its_gpu(other)
    partial = copy.deepcopy(recorded)
    del partial["notebooks"]["05_layer_to_layer"]
    assert not closing.timed_on_its_gpu(partial)
    assert closing.measured_run(partial)[1].endswith(GPU_RUN_PATH.name)
    failed = copy.deepcopy(recorded)
    failed["notebooks"]["01_gradient_accumulation"]["status"] = "failed"
    assert not closing.timed_on_its_gpu(failed)
    lines = closing.gpu_run_lines(recorded, closing.gpu_run_rows(recorded), "this page's results.json")
    assert "(this page's results.json)" in lines[0] and GPU_RUN_PATH.name not in lines[0]


def test_where_launches_set_every_rows_pace_the_sentence_names_the_with_launches_first(results):
    rows = closing.one_device_rows(results, "t4")
    order, launch_order = closing.cost_order(rows), closing.with_launches_order(rows)
    sentence = closing.order_sentence(order, launch_order=launch_order)
    assert sentence.startswith(closing.order_sentence(order))  # the counted-work order's sentence, then the clause
    clause = f"counted with them, {launch_order[0]['technique']} comes first"
    every = all(r["launch_bound"] for r in rows) and launch_order[0]["chapter"] != order[0]["chapter"]
    assert (clause in sentence) == every
    unbound = [{**r, "launch_bound": False} for r in rows]  # the work sets some row's pace: no such clause
    assert closing.order_sentence(closing.cost_order(unbound), launch_order=closing.with_launches_order(unbound)) == \
        closing.order_sentence(closing.cost_order(unbound))


def test_the_side_by_side_line_names_the_gradscaler_only_where_a_row_has_one(results):
    rows = closing.one_device_rows(results)
    chosen = closing.search_figures(results)
    table = {r["chapter"]: r["time_ratio"] for r in rows}
    chosen["ratios"] = {n: table[n[:2]] for n in chosen["ratios"] if n[:2] in table}  # ordered as the rows: no flip
    scaled = any("GradScaler" in r["technique"] for r in rows)
    assert scaled  # the fixture's page projects on a T4: fp16 with a GradScaler
    assert "without a GradScaler's kernels" in closing.side_by_side_line(rows, chosen)
    plain = [dict(r, technique=r["technique"].replace(" + GradScaler", "")) for r in rows]  # a bf16 GPU's rows
    line = closing.side_by_side_line(plain, chosen)
    assert "the same way" in line and "GradScaler" not in line


def test_the_ranking_line_names_the_projection_the_measured_steps_lay_nearer():
    run, source = closing.measured_run(None)  # the recorded H200 run: launch-bound steps at this size
    rows = closing.gpu_run_rows(run)
    line = closing.ranking_line(rows, source)
    nearer = sum(abs(math.log(r["launches"] / r["measured"])) < abs(math.log(r["roofline"] / r["measured"]))
                 for r in rows)
    within = sum(abs(math.log(r["launches"] / r["measured"])) <= math.log(closing.NEAR) for r in rows)
    assert f", {nearer} of {len(rows)} timed steps lay nearer the with-launches prediction (within 1.25x of it for " \
           f"{within};" in line
    assert closing.supported_projection(rows) == "launches"
    assert nearer > len(rows) / 2 and "read the with-launches figures" in line, line
    flipped = [dict(r, launches=r["roofline"], roofline=r["launches"]) for r in rows]  # the other way round
    assert "read the work-alone figures" in closing.ranking_line(flipped, source)
    same = [dict(r, launches=r["roofline"]) for r in rows]  # the two predictions agree: neither leads
    assert closing.ranking_line(same, source).endswith("neither projection leads; read both")


def test_the_launch_reading_names_the_first_by_launches_and_the_rows_slower_than_plain(results):
    rows = closing.one_device_rows(results, "t4")
    order = closing.with_launches_order(rows)
    line = closing.launch_reading(order)
    assert line.startswith(f"read so, {order[0]['technique']} comes first ({order[0]['time_ratio_launches']:.2f}x")
    slower = [r for r in order if r["time_ratio_launches"] > 1 + closing.TIME_TOLERANCE]
    assert ("every technique makes the step slower" in line) == (len(slower) == len(order))
    run, _ = closing.measured_run(None)
    l2l = next(r for r in closing.gpu_run_rows(run) if r["technique"] == "layer-to-layer")
    with_rows = closing.launch_reading(order, gpu_rows=closing.gpu_run_rows(run))
    leads = {order[0]["chapter"]} | {order[p - 1]["chapter"] for p in closing.ties(order)[order[0]["technique"]]}
    assert (f"measured {l2l['measured']:.2f}x against {l2l['launches']:.2f}x with launches" in with_rows) == \
        bool(leads & {"04", "05"}), with_rows
    faster = [dict(r, time_ratio_launches=0.5) if r is order[-1] else r for r in order]  # one row under the plain step
    assert "slower than the plain step so counted: " in closing.launch_reading(closing.with_launches_order(faster))


def test_the_held_line_gives_a_timed_steps_measurement_beside_both_projections():
    run, _ = closing.measured_run(None)
    r = next(row for row in closing.gpu_run_rows(run) if row["technique"] == "bf16 autocast")
    line = closing.held_line(run, "bf16 autocast")
    assert f"took {r['measured']:.2f}x the plain step's time (by the work {r['roofline']:.2f}x, with launches " \
           f"{r['launches']:.2f}x)" in line and "recorded H200 run" in line
    nearer = abs(math.log(r["launches"] / r["measured"])) < abs(math.log(r["roofline"] / r["measured"]))
    assert ("the launches' projection lay nearer" if nearer else "the work's projection lay nearer") in line
    assert line.endswith("saves memory, not time" if r["measured"] > 1 else "faster than the plain one")


def test_chapter_08s_launch_lines_name_what_beats_its_answer_and_what_to_train_at_this_size():
    ratios = {"02 activation checkpointing": 0.63, "01 gradient accumulation": 0.97, "04 activation offload": 1.5}
    lines = closing.search_launch_lines(1.19, 0.56, ratios, 0.95)
    assert "the search's answer runs at 1.19x the plain step's speed; counting the host's launches" in lines[0]
    assert lines[0].endswith("at this size, at 0.56x: behind 02 activation checkpointing")
    assert lines[1].startswith("which projection to read:")  # the recorded run supports the launches' (test above)
    assert lines[2].startswith("read so, train 02 activation checkpointing at this size (0.63x the answer's time; 02 "
                               "not timed on that GPU run); ")  # (the recorded run timed 01, 03 and 05)
    tied = closing.search_launch_lines(1.19, 0.56, dict(ratios, **{"04 activation offload": 0.65}), 0.95)
    assert "(0.63x the answer's time; tied with 04 activation offload, within the 1.053x tie margin; 02 and 04 not " \
           "timed on that GPU run)" in tied[2]
    timed_pick = closing.search_launch_lines(1.19, 0.56, {"01 gradient accumulation": 0.63}, 0.95)
    assert "(0.63x the answer's time); " in timed_pick[2]  # 01: timed there, nothing to add
    ties_only = closing.search_launch_lines(1.19, 0.56, {"01 gradient accumulation": 0.97}, 0.95)
    assert ties_only[0].endswith("tied with 01 gradient accumulation (under 1.053x apart)") and len(ties_only) == 2
    assert closing.train_at_this_size(ratios, 0.95) == ("02 activation checkpointing", [])  # (the summary's row)
    assert closing.train_at_this_size(dict(ratios, **{"04 activation offload": 0.65}), 0.95) == (
        "02 activation checkpointing", ["04 activation offload"])
    assert closing.train_at_this_size({"01 gradient accumulation": 0.97}, 0.95) is None  # a tie: train the answer
