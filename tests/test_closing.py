"""The closing page (notebook 10) and labkit.tools.closing: figures read from results.json, the order computed from them.

The page's figures in the tests come from tests/data/closing_results.json: a real `make run`'s results.json cut to
the records the page reads (`closing.fixture_from`; its `note` says so and the page prints it). No chapter runs
for these tests. `make test` points nbval's run of the page at the same file ($LABKIT_RESULTS, Makefile).
To renew it after a `make run`:

    .venv/bin/python -c "import json; from labkit.tools import closing; r = json.load(open('build/results.json')); \\
        json.dump(closing.fixture_from(r, closing.FIXTURE_NOTE), open('tests/data/closing_results.json', 'w'), indent=1)"
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

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


def test_every_record_the_page_reads_is_recorded_by_its_chapter():
    for stem, keys in closing.SOURCES.items():
        source = (ROOT / "notebooks" / f"{stem}.ipynb").read_text()
        for key in keys:
            assert re.search(rf'record\(\\?"{key}\\?"', source), f"{stem} does not record {key}: update closing.SOURCES"


def test_missing_results_and_missing_chapters_are_named_with_the_command(results):
    gaps = closing.missing(None)
    assert set(gaps) == set(closing.SOURCES) and set(gaps.values()) == {"not run"}
    partial = copy.deepcopy(results)
    del partial["notebooks"]["06_model_and_pipeline_parallel"]
    partial["notebooks"]["03_mixed_precision"]["status"] = "failed"
    del partial["notebooks"]["05_layer_to_layer"]["measurements"]["l2l_peak_bytes"]
    gaps = closing.missing(partial)
    assert gaps == {"03_mixed_precision": "its last run failed", "05_layer_to_layer": "did not record l2l_peak_bytes",
                    "06_model_and_pipeline_parallel": "not run"}
    line = closing.run_first(gaps)
    assert "--only 03 --only 05 --only 06" in line and "make run" in line
    assert closing.missing(partial, closing.SEARCH) == {}


def test_rows_are_the_chapters_figures(results):
    rows = {r["chapter"]: r for r in closing.one_device_rows(results)}
    m = results["notebooks"]["04_activation_offload"]["measurements"]
    assert rows["04"]["saved"] == m["baseline_peak_bytes"] - m["device_peak_bytes_offload"]
    assert rows["04"]["time_ratio"] == m["step_time_ratio_offload"]
    mp = results["notebooks"]["03_mixed_precision"]["measurements"]
    assert rows["03"]["time_ratio"] == pytest.approx(1 / mp["throughput_ratio_half"])
    assert rows["03"]["technique"] == f"{mp['half_precision']} autocast"
    acc = results["notebooks"]["01_gradient_accumulation"]["measurements"]
    k = acc["fitting_accum_steps"]
    assert rows["01"]["time_ratio"] == acc["step_time_ratio_by_accum_steps"][str(k)] and rows["01"]["time_ranked"]
    assert rows["04"]["fits"] == (m["device_peak_bytes_offload"] <= closing.budget_bytes(results))


def _set_cost(results, chapter_stem, key, value):
    results["notebooks"][chapter_stem]["measurements"][key] = value


def _set_time_ratio(results: dict, chapter: str, ratio: float) -> dict:
    """Return a copy of results where chapter's technique takes `ratio` x the plain step's time."""
    results = copy.deepcopy(results)
    stem = next(s for s in closing.SOURCES if s.startswith(chapter))
    m = results["notebooks"][stem]["measurements"]
    side = "slower" if ratio > 1 else "faster" if ratio < 1 else "not told apart"  # the chapter's verdict, where kept
    if chapter == "01":
        ratios = m["step_time_ratio_by_accum_steps"]
        m["step_time_ratio_by_accum_steps"] = {k: 1.0 if int(k) == 1 else ratio for k in ratios}
        m["step_time_verdict_by_accum_steps"] = {k: "not told apart" if int(k) == 1 else side for k in ratios}
    elif chapter == "03":
        m["throughput_ratio_half"] = 1 / ratio
    else:
        m[{"02": "step_time_ratio_full_checkpoint", "04": "step_time_ratio_offload",
           "05": "step_time_ratio_l2l"}[chapter]] = ratio
    if chapter == "04":
        m["step_time_verdict_offload"] = side
    return results


def test_the_order_and_its_sentence_change_with_the_figures(results):
    rows = closing.cost_order(closing.one_device_rows(results))
    order, sentence = [r["technique"] for r in rows], closing.order_sentence(rows)
    ranked = [r["technique"] for r in rows if r["time_ranked"]]
    unranked = [r["technique"] for r in rows if not r["time_ranked"]]
    assert order == ranked + unranked  # a time not ranked never goes ahead of one that is
    first = rows[0]
    last = next(r for r in reversed(rows) if r["time_ranked"])
    # the first technique made ten times slower goes to the end of the ranked ones, and the sentence names the next
    slow = closing.cost_order(closing.one_device_rows(_set_time_ratio(results, first["chapter"], 10.0)))
    assert [r["technique"] for r in slow] == ranked[1:] + ranked[:1] + unranked
    assert closing.order_sentence(slow) != sentence
    assert closing.order_sentence(slow).startswith(f"On this run {order[1]} comes first")
    # the last ranked one made free (the plain step's time) moves ahead of every technique that costs time
    free = closing.cost_order(closing.one_device_rows(_set_time_ratio(results, last["chapter"], 1.0)))
    names = [r["technique"] for r in free]
    paying = [r["technique"] for r in rows if r["time_ranked"] and closing.cost_per_mib(r) > 0 and r is not last]
    assert names != order and all(names.index(last["technique"]) < names.index(p) for p in paying), names
    # made faster than every other, it comes first
    fast = closing.cost_order(closing.one_device_rows(_set_time_ratio(results, last["chapter"], 0.01)))
    assert fast[0]["technique"] == last["technique"]
    assert "saved memory and the step got faster" in closing.order_sentence(fast)


def test_a_time_judged_unreliable_is_not_ranked(results):
    unreliable = copy.deepcopy(results)
    unreliable["notebooks"]["03_mixed_precision"]["measurements"]["throughput_ratio_half_reliable"] = False
    rows = closing.cost_order(closing.one_device_rows(unreliable))
    r03 = next(r for r in rows if r["chapter"] == "03")
    assert not r03["time_ranked"] and "unreliable" in r03["timing"]
    assert rows.index(r03) >= sum(r["time_ranked"] for r in rows)
    order = [r["technique"] for r in rows]
    for ratio in (0.01, 10.0):  # an unreliable time moves nothing
        changed = closing.cost_order(closing.one_device_rows(_set_time_ratio(unreliable, "03", ratio)))
        assert [r["technique"] for r in changed] == order


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
    for name in chosen["same"]:
        assert chosen["noise"] >= abs(chosen["ratios"][name] - 1)  # two copies of one setting widen the band
    lines = closing.search_lines(chosen)
    assert sum("the same setting" in line for line in lines) == len(chosen["same"])
    changed = copy.deepcopy(results)
    m = changed["notebooks"]["08_memory_aware_search"]["measurements"]
    name = next(iter(m["fastest_vs_chapters_paired_ratio"]))
    m["chapters_with_fastest_setting"], m["fastest_vs_chapters_paired_ratio"][name] = [name], 1.3
    chosen = closing.search_figures(changed)
    assert chosen["noise"] == pytest.approx(0.3) and f"against {name}: the same setting" in closing.search_lines(chosen)[0]


def test_the_several_device_lines_print_every_bubble_and_say_a_tie(results):
    f = closing.several_device_figures(results)
    text = "\n".join(closing.several_device_lines(f, 8))
    for schedule, bubble in f["bubble_by_microbatches"].items():
        for m, b in bubble.items():
            assert f"M={m}: {b:.0%}" in text
    assert "with its share of the batch" in text
    comm, chosen, pays = f["comm_bytes"], f["use_when"]["whole_budget"], f["pays"]
    tied = [p for p, v in f["points"].items() if v.get("whole budget") and p != chosen and comm[p] == comm[chosen]
            and pays.get(p) == pays.get(chosen)]
    assert ("ties for the fewest" in text) == bool(tied)
    sentence = next(line for line in text.split("\n") if line.startswith("a few GPUs"))
    for p in pays:  # a point that pays in precision or recomputation never ties with one that pays nothing
        if p != chosen and pays[p] != pays.get(chosen):
            assert p not in sentence.split("ties for the fewest")[-1].split(";")[0]


def test_a_bubble_rise_is_told_as_a_finding_only_where_chapter_06_told_it_apart(results):
    f = closing.several_device_figures(results)
    rising = {"GPipe": {1: 0.5, 4: 0.3, 16: 0.4}}  # falls to M = 4, then rises
    for told in (True, False):
        changed = dict(f, bubble_by_microbatches=rising, bubble_theory={}, bubble_rise_told={"GPipe": told})
        text = "\n".join(closing.several_device_lines(changed, 8))
        assert "rises" in text and ("not told apart" in text) == (not told)


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
    # one run, without chapter 06's figures: the one-device order still prints, the several-device part says what
    # is missing (nbval runs the page on the whole fixture)
    partial = copy.deepcopy(results)
    del partial["notebooks"]["06_model_and_pipeline_parallel"]
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    entry = execute_notebook(PAGE, RESULTS=str(tmp_path / "partial.json"), timeout_s=120)
    assert entry["status"] == "ok", entry.get("error")
    text = _outputs(entry["path"])
    order = closing.cost_order(closing.one_device_rows(results))
    assert closing.order_sentence(order) in text  # the one-device part does not need 06
    assert f"1. {order[0]['technique']}" in text and results["note"] in text
    assert entry["measurements"]["order_one_device"] == [r["technique"] for r in order]
    assert entry["figure_problems"] == [], entry["figure_problems"]  # the page's own figures pass the check
    assert "run these chapters first: 06_model_and_pipeline_parallel (not run)" in text
    assert "skipped: needs the figures of chapter 06" in text


def test_a_time_not_told_apart_from_the_plain_step_costs_nothing(results):
    told = _set_time_ratio(_set_time_ratio(results, "04", 1.30), "01", 1.20)
    apart = {r["chapter"]: r for r in closing.one_device_rows(told)}
    assert apart["04"]["verdict"] == "slower" and closing.cost_per_mib(apart["04"]) > 0
    m = told["notebooks"]["04_activation_offload"]["measurements"]
    m["step_time_verdict_offload"] = "not told apart"  # the same time, within the chapter's noise
    rows = closing.cost_order(closing.one_device_rows(told))
    r04 = next(r for r in rows if r["chapter"] == "04")
    assert r04["time_ranked"] and closing.cost_per_mib(r04) == 0.0 and not closing.saves_time(r04)
    paying = [r for r in rows if r["time_ranked"] and closing.cost_per_mib(r) > 0]
    assert all(rows.index(r04) < rows.index(r) for r in paying)
    assert "no cost told apart" in closing.order_line(rows.index(r04) + 1, r04, rows)
    assert "did not tell its time" in r04["timing"]


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
