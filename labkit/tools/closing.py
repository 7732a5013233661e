"""Chapter 10's figures: what each technique saved and cost, read from the chapters' records in results.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

from labkit.costs import work_from_record
from labkit.gpus import (CUDA_NAMES, EAGER_OPERATOR_S, GPU_AUTO, GPU_RUN_PATH, RESERVE_FRACTION, DeviceProfile,
                         device_profile, step_time)
from labkit.meter import format_bytes
from labkit.results import results_path  # noqa: F401  (the closing page reads it here)

MiB = 2**20
# chapter stem -> the records this page reads from it
SOURCES = {
    "00_where_the_memory_goes": ("measured_peak_bytes", "budget_bytes", "step_s"),
    "01_gradient_accumulation": ("peak_bytes_by_accum_steps", "work_by_accum_steps", "fitting_accum_steps"),
    "02_activation_checkpointing": ("peak_bytes_checkpointed", "work_plain", "work_every_block"),
    "03_mixed_precision": ("half_precision", "peak_bytes_fp32", "peak_bytes_half", "work_fp32", "work_half",
                           "work_fp16_scaled"),
    "04_activation_offload": ("baseline_peak_bytes", "device_peak_bytes_offload", "work_baseline", "work_offload"),
    "05_layer_to_layer": ("plain_peak_bytes", "l2l_peak_bytes", "work_plain", "work_l2l"),
    "06_model_and_tensor_parallel": ("peak_bytes_by_rank_model_parallel", "utilisation_model_parallel",
                                     "wire_bytes_by_rank_model_parallel", "wire_bytes_per_rank_tensor_parallel"),
    "06b_pipeline_parallel": ("bubble_fraction_measured_by_microbatches", "bubble_fraction_theory_by_microbatches",
                              "bubble_trend_by_schedule"),
    "07_sharded_data_parallel": ("fits_whole_and_1_over_n_budget_by_point", "comm_bytes_per_step_by_stage",
                                 "rank_budget_bytes", "use_when", "pays_by_point",
                                 "peak_bytes_per_param_per_rank_by_stage", "bytes_per_param_per_rank_by_stage",
                                 "comm_bytes_by_collective_by_stage"),
    "08_memory_aware_search": ("fastest_fitting_params", "fastest_fitting_peak_bytes",
                               "fastest_vs_chapters_speed_ratio", "fastest_vs_chapters_speed_ratio_with_launches",
                               "timing_noise_ratio",
                               "chapters_with_fastest_setting", "speed_on"),
}


def load(path: str | Path | None = None) -> dict | None:
    """Return the parsed results.json (None when there is none or it is not JSON)."""
    target = results_path(path)
    try:
        return json.loads(target.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


ONE_DEVICE = ("00", "01", "02", "03", "04", "05")  # the chapters each section of the page reads
SEVERAL_DEVICES = ("00", "06", "06b", "07")
SEARCH = ("08",)


def chapter(stem: str) -> str:
    """Return a notebook stem's chapter number: "06b" for "06b_pipeline_parallel"."""
    return stem.split("_", 1)[0]


def missing(results: dict | None, chapters=tuple(chapter(c) for c in SOURCES)) -> dict[str, str]:
    """Return {chapter: why its figures are missing} for each of `chapters` ("03", ...) this page cannot read."""
    notebooks = (results or {}).get("notebooks", {})
    gaps = {}
    for stem, keys in SOURCES.items():
        if chapter(stem) not in chapters:
            continue
        entry = notebooks.get(stem)
        if entry is None:
            gaps[stem] = "not run"
        elif entry.get("status") != "ok":
            gaps[stem] = "its last run failed"
        else:
            absent = [k for k in keys if k not in entry.get("measurements", {})]
            if absent:
                gaps[stem] = f"did not record {', '.join(absent)}"
    return gaps


def run_first(gaps: dict[str, str]) -> str:
    """Return the line that names the chapters to run first, and the command that runs them."""
    only = " ".join(dict.fromkeys(f"--only {chapter(stem)}" for stem in gaps))  # "06", "06b", ...
    return ("run these chapters first: " + "; ".join(f"{stem} ({why})" for stem, why in gaps.items())
            + f". `make run` runs them all and then this page; `.venv/bin/python -m workbook.runner {only}` "
            "runs only these, then run this page again")


def skip_line(gaps: dict[str, str]) -> str:
    """Return the short line a section prints when it skips: the chapters it needs (named in full above)."""
    chapters = dict.fromkeys(chapter(stem) for stem in gaps)  # "06", "06b", ...
    return f"skipped: needs the figures of chapter {', '.join(chapters)} (see above)"


def _m(results: dict, stem: str) -> dict:
    return results["notebooks"][stem]["measurements"]


def _by_int_key(d: dict) -> dict[int, float]:
    return {int(k): v for k, v in d.items()}


def budget_bytes(results: dict) -> int:
    """Return the running example's memory budget (chapter 00's record)."""
    return _m(results, "00_where_the_memory_goes")["budget_bytes"]


TIME_TOLERANCE = 0.05  # two projected step-time ratios closer than this (a fraction of a step): tied, the roofline
#                        and a published efficiency are not that exact


def one_device_rows(results: dict, gpu: str | DeviceProfile = GPU_AUTO) -> list[dict]:
    """Return one row per one-device technique: peaks before and after, bytes saved, and the step-time ratio on `gpu`.

    The ratio is each chapter's counted work (labkit.work: the plain step's and the technique's, on the running
    example) projected on `gpu` by labkit.gpus.step_time: the estimate where a published run gives the GPU class's
    achieved share of peak, else the roofline. Copies over the host link (04, 05) overlap compute, as on a side stream.
    `time_ratio_launches` is the same ratio with the host's launches counted (StepTime.with_launches_s);
    `launch_bound` says whether either step's launches take longer than its work.
    """
    device = gpu if isinstance(gpu, DeviceProfile) else device_profile(gpu)
    budget = budget_bytes(results)
    plain_00 = _m(results, "00_where_the_memory_goes")["measured_peak_bytes"]
    acc = _m(results, "01_gradient_accumulation")
    peaks = _by_int_key(acc["peak_bytes_by_accum_steps"])
    k = acc["fitting_accum_steps"] or max(peaks)
    works = _by_int_key(acc["work_by_accum_steps"])
    ck, mp = _m(results, "02_activation_checkpointing"), _m(results, "03_mixed_precision")
    off, l2l = _m(results, "04_activation_offload"), _m(results, "05_layer_to_layer")
    rows = [
        dict(technique=f"gradient accumulation, k = {k}", chapter="01", before=peaks[min(peaks)], after=peaks[k],
             work=(works[min(works)], works[k]), source="peak and work by accumulation steps"),
        dict(technique="activation checkpointing, every block", chapter="02", before=plain_00,
             after=ck["peak_bytes_checkpointed"], work=(ck["work_plain"], ck["work_every_block"]),
             source="peak: chapter 00's plain step and 02's; work: 02's plain and every-block steps"),
        dict(chapter="03", before=mp["peak_bytes_fp32"], after=mp["peak_bytes_half"], **_half_row(mp, device)),
        dict(technique="activation offload", chapter="04", before=off["baseline_peak_bytes"],
             after=off["device_peak_bytes_offload"], work=(off["work_baseline"], off["work_offload"]),
             source="device peaks, and the work with the bytes over the host link"),
        dict(technique="layer-to-layer (L2L)", chapter="05", before=l2l["plain_peak_bytes"],
             after=l2l["l2l_peak_bytes"], work=(l2l["work_plain"], l2l["work_l2l"]),
             source="device peaks, and the work with the bytes over the host link"),
    ]
    kind = "an estimate" if device.efficiency is not None else "the roofline, a bound"
    for row in rows:
        before, after = (step_time(work_from_record(w), device) for w in row.pop("work"))
        row["time_ratio"] = after.time_s / before.time_s
        row["time_ratio_launches"] = after.with_launches_s / before.with_launches_s  # the host's launches counted
        row["launch_bound"] = before.launch_bound or after.launch_bound  # launches, not the work, set a step's pace
        row["saved"] = row["before"] - row["after"]
        row["fits"] = row["after"] <= budget
        row["headroom"] = budget - row["after"]  # what the budget leaves for what the tensors do not show
        row["timing"] = f"counted work on the {device.name} ({kind})"
    return rows


def _half_row(mp: dict, device: DeviceProfile) -> dict:
    """Return chapter 03's row's technique, work and source: the 16-bit step `device` runs, fp16 with a GradScaler
    where it has no bf16 units (its peaks are 16-bit either way)."""
    if device.half == "fp16":
        return dict(technique="fp16 autocast + GradScaler", work=(mp["work_fp32"], mp["work_fp16_scaled"]),
                    source=f"peaks of {mp['half_precision']} (a GPU's autocast dtypes) and fp32 steps (16 bits hold as "
                           "many bytes either way); "
                           "the work of an fp32 and an fp16 + GradScaler step, as the GPU runs it (counted)")
    return dict(technique=f"{mp['half_precision']} autocast", work=(mp["work_fp32"], mp["work_half"]),
                source="peaks (the 16-bit one with a GPU's autocast dtypes), and the work of an fp32 and a 16-bit "
                       "step (counted)")


def cost_per_mib(row: dict) -> float:
    """Return the extra step time a row pays per MiB it saves (a fraction of a step; inf when it saves nothing)."""
    if row["saved"] <= 0:
        return float("inf")
    return (row["time_ratio"] - 1) / (row["saved"] / MiB)


def saves_time(row: dict, tolerance: float = TIME_TOLERANCE) -> bool:
    """Return whether a row's ranked step time is below the plain step's by more than `tolerance`."""
    return row["saved"] > 0 and row["time_ratio"] < 1 - tolerance


def rank_key(row: dict, tolerance: float = TIME_TOLERANCE) -> tuple:
    """Return the key the order sorts by: techniques that save time first (most time saved first), then those that
    pay, least extra step time per MiB saved first."""
    if saves_time(row, tolerance):
        return (0, row["time_ratio"])
    return (1, cost_per_mib(row), -row["saved"])


def cost_order(rows: list[dict], tolerance: float = TIME_TOLERANCE) -> list[dict]:
    """Return the rows in the order to try them (`rank_key`)."""
    return sorted(rows, key=lambda r: rank_key(r, tolerance))


def tied(a: dict, b: dict, tolerance: float = TIME_TOLERANCE) -> bool:
    """Return whether two rows are not told apart: their step times, each uncertain by `tolerance` of a step, allow
    either to come first (compared by time saved when both save time, else by time per MiB saved)."""
    if min(a["saved"], b["saved"]) <= 0:
        return False
    if saves_time(a, tolerance) != saves_time(b, tolerance):
        return False
    if saves_time(a, tolerance):
        return abs(a["time_ratio"] - b["time_ratio"]) <= 2 * tolerance
    return abs(cost_per_mib(a) - cost_per_mib(b)) <= tolerance / (a["saved"] / MiB) + tolerance / (b["saved"] / MiB)


def ties(order: list[dict], tolerance: float = TIME_TOLERANCE) -> dict[str, list[int]]:
    """Return {technique: the places (1-based) of the neighbours in `order` it is tied with}."""
    out: dict[str, list[int]] = {r["technique"]: [] for r in order}
    for i, (a, b) in enumerate(zip(order, order[1:])):
        if tied(a, b, tolerance):
            out[a["technique"]].append(i + 2)
            out[b["technique"]].append(i + 1)
    return out


def with_launches_order(rows: list[dict], tolerance: float = TIME_TOLERANCE) -> list[dict]:
    """Return the rows in the same rule's order, ranked by their step times with the host's launches (chapter 10)."""
    return cost_order([{**r, "time_ratio": r["time_ratio_launches"]} for r in rows], tolerance)


def chapters_in_order(order: list[dict], tolerance: float = TIME_TOLERANCE) -> str:
    """Return the order's chapters, " ≈ " between tied neighbours, else ", " (chapter 10)."""
    out = order[0]["chapter"] if order else ""
    for a, b in zip(order, order[1:]):
        out += (" ≈ " if tied(a, b, tolerance) else ", ") + b["chapter"]
    return out


def places(order: list[dict], tolerance: float = TIME_TOLERANCE) -> dict[str, str]:
    """Return {technique: its place in `order`}: "n=" for each of a run of tied neighbours (chapters_in_order's
    " ≈ "), which all share the run's first place n; the next row's place counts them all (chapter 10)."""
    runs: list[list[dict]] = []
    for i, row in enumerate(order):
        if i and tied(order[i - 1], row, tolerance):
            runs[-1].append(row)
        else:
            runs.append([row])
    out, place = {}, 1
    for run in runs:
        out.update({r["technique"]: f"{place}=" if len(run) > 1 else str(place) for r in run})
        place += len(run)
    return out


def launches_clause(row: dict) -> str:
    """Return "; with the host's launches N.NNx" for a launch-bound row, else "" (chapter 10)."""
    return f"; with the host's launches {row['time_ratio_launches']:.2f}x" if row.get("launch_bound") else ""


def order_line(place: int, row: dict, order: list[dict], tolerance: float = TIME_TOLERANCE) -> str:
    """Return one numbered line of the order: what the row saves and what it pays."""
    cost = cost_per_mib(row)
    if cost == float("inf"):
        paid = "saves nothing here"
    elif saves_time(row, tolerance):
        paid = f"free by its counted work: {row['time_ratio']:.2f}x the plain step's time{launches_clause(row)}"
    else:
        paid = f"pays {cost:.2%} of a step per MiB ({row['time_ratio']:.2f}x the step time{launches_clause(row)})"
    with_ = ties(order, tolerance)[row["technique"]]
    return (f"{place}. {row['technique']} (chapter {row['chapter']}): saves {format_bytes(row['saved'])}, {paid}"
            + (f"; tied with place {', '.join(map(str, with_))} within the tolerance" if with_ else "")
            + (f"; fits the budget alone, {format_bytes(row['headroom'])} to spare" if row["fits"] else ""))


def order_sentence(order: list[dict], tolerance: float = TIME_TOLERANCE, launch_order: list[dict] | None = None) -> str:
    """Return what the order says, in words computed from its figures: which comes first, which fits first; and,
    where the host's launches set every row's pace, what comes first in `launch_order` (with_launches_order's)."""
    text = _order_sentence(order, tolerance)
    if not launch_order or not all(r["launch_bound"] for r in order) or launch_order[0]["chapter"] == order[0]["chapter"]:
        return text
    lead = launch_order[0]
    with_ = ties(launch_order, tolerance)[lead["technique"]]
    return (text + f" By the projection ({EAGER_OPERATOR_S * 1e6:.1f} µs per launch, an H200 host's rate) the host's "
            f"launches set every row's pace at this size; counted with them, {lead['technique']} "
            f"comes first ({lead['time_ratio_launches']:.2f}x the plain step's time"
            + (f", tied with {', '.join(launch_order[p - 1]['technique'] for p in with_)}" if with_ else "")
            + "); the measured GPU run below shows, for the techniques it timed, how far either prediction held.")


def _order_sentence(order: list[dict], tolerance: float) -> str:
    first = order[0]
    if cost_per_mib(first) == float("inf"):
        return "no technique saved memory on this run: nothing to order"
    cost = cost_per_mib(first)
    why = (f"it saves memory and its counted work projects a shorter step ({first['time_ratio']:.2f}x the plain "
           f"step's time{launches_clause(first)}" + (", and the launches set the pace at this size" if
                                                     first.get("launch_bound") else "") + ")"
           if saves_time(first, tolerance) else f"it pays the least time per MiB it saves ({cost:.2%} of a step)")
    with_ = ties(order, tolerance)[first["technique"]]
    if with_:
        why += f", tied with {', '.join(order[p - 1]['technique'] for p in with_)} within the tolerance"
    fit = next((r for r in order if r["fits"]), None)
    if fit is None:
        then = ("none fits the budget alone on this run: combine them in this order (chapter 08 searches the "
                "combinations)")
    else:
        share = fit["headroom"] / (fit["after"] + fit["headroom"])
        covers = share >= RESERVE_FRACTION
        spare = (f", leaving {format_bytes(fit['headroom'])} ({share:.0%} of the budget) for what the tensors do not "
                 f"show, {'at least' if covers else 'less than'} the {RESERVE_FRACTION:.0%} chapter 09's planner holds "
                 "back on a GPU" + ("" if covers else ": there, add the next technique in the order too"))
        if fit is first:
            then = "and it fits the budget alone" + spare + (": stop there" if covers else "")
        else:
            place = order.index(fit) + 1
            then = (f"the first in the order that fits the budget alone is {fit['technique']} (place {place}, "
                    f"saves {format_bytes(fit['saved'])} at {fit['time_ratio']:.2f}x the step time)" + spare)
    return f"On this run {first['technique']} comes first: {why}; {then}."


def point_peak_bytes(sharded: dict, point: str) -> float | None:
    """Return chapter 07's peak per rank of `point` in bytes: its peak per parameter times the parameters, or None
    where chapter 07 recorded no peak per parameter for it (chapter 10).

    The parameters are DDP's all-reduced gradient bytes over its gradient bytes per parameter; the peak is rank 0's
    at chapter 07's N ranks, the N of its "1/N of it" budget.
    """
    verdicts = sharded["fits_whole_and_1_over_n_budget_by_point"]
    part = next(k for v in verdicts.values() for k in v if k != "whole budget")  # "1/N of it"
    ranks = part.split("/")[1].split()[0]
    by_point = sharded["peak_bytes_per_param_per_rank_by_stage"][ranks]
    if point not in by_point:
        return None
    grads = sharded["bytes_per_param_per_rank_by_stage"][ranks]["DDP"]["gradients"]
    params = sharded["comm_bytes_by_collective_by_stage"]["DDP"]["all_reduce"]["input_bytes"] / grads
    return sum(by_point[point].values()) * params


def ddp_peak_bytes(sharded: dict) -> float:
    """Return chapter 07's DDP peak per rank in bytes (point_peak_bytes) (chapter 10)."""
    return point_peak_bytes(sharded, "DDP")


def several_device_figures(results: dict) -> dict:
    """Return chapters 06, 06b and 07's figures for several devices: verdicts, bytes sent, per-rank peaks, the bubble."""
    mp, sh = _m(results, "06_model_and_tensor_parallel"), _m(results, "07_sharded_data_parallel")
    pp = _m(results, "06b_pipeline_parallel")
    peaks = list(mp["peak_bytes_by_rank_model_parallel"].values())
    bubble = pp["bubble_fraction_measured_by_microbatches"]  # {schedule: {micro-batches: fraction}}
    return dict(
        points=sh["fits_whole_and_1_over_n_budget_by_point"], comm_bytes=sh["comm_bytes_per_step_by_stage"],
        rank_budget=sh["rank_budget_bytes"], use_when=sh["use_when"], pays=sh["pays_by_point"],
        model_parallel_peak_max=max(peaks), model_parallel_ranks=len(peaks),
        plain_peak=_m(results, "00_where_the_memory_goes")["measured_peak_bytes"],
        budget=budget_bytes(results), ddp_peak=ddp_peak_bytes(sh),
        pick_peak=point_peak_bytes(sh, sh["use_when"]["whole_budget"]),  # chapter 07's pick for one device's budget
        pipeline_sent_max=max(mp["wire_bytes_by_rank_model_parallel"].values()),  # as chapter 06 prints them
        tensor_parallel_comm=mp["wire_bytes_per_rank_tensor_parallel"],
        utilisation=mp["utilisation_model_parallel"],
        bubble_by_microbatches={name: _by_int_key(v) for name, v in bubble.items()},
        bubble_theory=_by_int_key(pp.get("bubble_fraction_theory_by_microbatches") or {}),
        bubble_trend=pp["bubble_trend_by_schedule"],  # {schedule: 06b's verdict on the bubble over M, by its spread}
    )


def search_figures(results: dict) -> dict:
    """Return chapter 08's choice: knobs, peak, speed ratios (each chapter's step time over the choice's; with the
    host's launches in `ratios_launches`, where projected), `same` (chapters with its setting), `speed_on` (projected
    on a GPU, or measured) and `noise`.

    noise: a timing's widest gap between two copies of one setting, the noise control's and those chapters' alike; 0
    for a projection (arithmetic on counted work: no noise).
    """
    m = _m(results, "08_memory_aware_search")
    same = list(m.get("chapters_with_fastest_setting") or [])
    ratios = m["fastest_vs_chapters_speed_ratio"]
    noise = 0.0 if m["timing_noise_ratio"] is None else max(
        [abs(m["timing_noise_ratio"] - 1)] + [abs(ratios[n] - 1) for n in same if n in ratios])
    return dict(params=m["fastest_fitting_params"], peak_bytes=m["fastest_fitting_peak_bytes"],
                ratios=ratios, noise=noise, same=same, speed_on=m["speed_on"],
                ratios_launches=m.get("fastest_vs_chapters_speed_ratio_with_launches") or {})


def search_lines(chosen: dict) -> list[str]:
    """Return one line per chapter setting: the chosen setting's speed against it, or why there is none."""
    lines = []
    for name, ratio in chosen["ratios"].items():
        if name in chosen["same"]:
            lines.append(f"  against {name}: the same setting" + (
                f" (timed {ratio:.2f}x apart: two copies of one setting, part of the noise band)" if chosen["noise"]
                else ""))
        elif abs(ratio - 1) > chosen["noise"]:
            launches = chosen.get("ratios_launches", {}).get(name)
            lines.append(f"  against {name}: {'projected ' if chosen['speed_on'].startswith('projected') else ''}"
                         f"{ratio:.2f}x as fast" + (f" by the work, {launches:.2f}x with the host's launches"
                                                    if launches is not None else ""))
        else:
            lines.append(f"  against {name}: {ratio:.2f}x (within the timing's noise of {chosen['noise']:.1%}: "
                         "not told apart)")
    return lines


def side_by_side_line(rows: list[dict], chosen: dict) -> str:
    """Return chapter 08's order of the chapters' settings (its speeds: projected on a GPU, or measured) and the
    ranked pairs of `rows` (projected on this page's GPU) it puts the other way round by more than its noise band."""
    by = {name[:2]: t for name, t in chosen["ratios"].items()}  # chapter -> its step time over the search's choice's
    line = (f"chapter 08's speeds of the chapters' settings ({chosen['speed_on']}; step time over its choice's, fastest "
            "first): " + ", ".join(f"{c} {by[c]:.2f}x" for c in sorted(by, key=by.get)))
    table = {r["chapter"]: r["time_ratio"] for r in rows if r["chapter"] in by}
    flipped = [f"{a} and {b}" for a in sorted(table) for b in sorted(table) if a < b
               and (table[a] - table[b]) * (by[a] - by[b]) < 0 and abs(by[a] / by[b] - 1) > chosen["noise"]]
    scaled = any("GradScaler" in r["technique"] for r in rows)  # this page's 03 row: fp16 with a GradScaler
    if not flipped:
        return (line + "; it orders the times above the same way" + (", or within its noise" if chosen["noise"] else "")
                + (" (both by counted work, the work alone; the ratios differ: chapter 08 counts the steps of its own "
                   "settings" + (", its 16-bit one without a GradScaler's kernels" if scaled else "")
                   + ", where the rows above count each chapter's step)" if chosen["speed_on"].startswith("projected")
                   else ""))
    if chosen["speed_on"].startswith("projected"):
        return (line + f"; it orders {', '.join(flipped)} the other way round from the times above: chapter 08 counted "
                "the steps of its own settings, projected on its GPU, where the rows above count each chapter's step")
    return (line + f"; it orders {', '.join(flipped)} the other way round from the GPU's times above: that GPU's "
            "measured order, not this page's projection")


def _fewest(fit: list[str], comm: dict, chosen: str, pays: dict) -> str:
    """Return "X sends the fewest (B)" or, where others that pay alike send exactly as much, "X ties ... with ..."."""
    tied = [p for p in fit if p != chosen and comm.get(p) == comm.get(chosen) and pays.get(p) == pays.get(chosen)]
    if not tied:
        return f"{chosen} sends the fewest bytes per rank of them ({format_bytes(comm[chosen])} per step)"
    return (f"{chosen} ties for the fewest bytes sent per rank ({format_bytes(comm[chosen])} per step) with "
            f"{', '.join(tied)}" + (f", all paying in {pays[chosen]}" if pays.get(chosen) else
                                   f", none paying in {' or '.join(sorted(set(pays.values())))}" if pays else "")
            + f"; chapter 07 picks {chosen}: of the tied, the lowest peak, then the fastest step with the host's "
              "launches")


def _follow_pick(f: dict) -> str:
    """Return ". Of the two, follow chapter 07's pick ..." with the figures that set it above DDP, where DDP fits one
    device's budget and chapter 07 picks another setup for it; else "" (the rule and the pick agree)."""
    pick, comm = f["use_when"]["whole_budget"], f["comm_bytes"]
    if not f["points"].get("DDP", {}).get("whole budget") or pick is None or pick.startswith("DDP"):
        return ""
    peaks = (f" and peaks at {format_bytes(f['pick_peak'])} per rank against DDP's {format_bytes(f['ddp_peak'])}"
             if f.get("pick_peak") is not None else "")
    sends = ("as many bytes per rank as DDP" if comm[pick] == comm["DDP"] else
             f"{format_bytes(abs(comm['DDP'] - comm[pick]))} {'fewer' if comm[pick] < comm['DDP'] else 'more'} bytes "
             "per rank than DDP")
    lower = f.get("pick_peak") is not None and f["pick_peak"] < f["ddp_peak"]
    buys = ("fewer bytes sent" if comm[pick] < comm["DDP"] else "room at no extra bytes" if lower else
            "a shorter step with the host's launches")  # chapter 07's order: bytes, then peak, then that step
    return (f". Of the two, follow chapter 07's pick on this run: {pick} sends {sends}{peaks}; the rule's DDP is the "
            f"default where sharding buys nothing, and here it buys {buys}")


def several_device_lines(f: dict, gpus_per_node: int) -> list[str]:
    """Return the few-GPU and many-GPU lines: each rule (chapters 06, 06b and 07) beside this run's figure that bears on it."""
    lines = []
    points, comm = f["points"], f["comm_bytes"]
    part = next((k for v in points.values() for k in v if k != "whole budget"), None)  # "1/N of it"
    ddp = points.get("DDP", {})
    whole_fit = [p for p, v in points.items() if v.get("whole budget")]
    part_fit = [p for p, v in points.items() if part and v.get(part)]
    lines.append(
        f"a few GPUs (2 to {gpus_per_node}, one machine): DDP when one rank's step, with its share of the batch "
        f"(the batch over N ranks), fits one GPU. Here DDP's peak per rank ({format_bytes(f['ddp_peak'])}) "
        + ("fits" if ddp.get("whole budget") else "does not fit") + f" one device's budget ({format_bytes(f['budget'])})"
        + f", although the whole batch's step on one device ({format_bytes(f['plain_peak'])}) "
        + ("does not" if f["plain_peak"] > f["budget"] else "does too")
        + (f"; {_fewest(whole_fit, comm, f['use_when']['whole_budget'], f['pays'])}" if whole_fit else "")
        + _follow_pick(f) + ".")
    lines.append(
        f"  when it does not fit (a device with {(part or '').replace(' of it', '')} of the budget, "
        f"{format_bytes(f['rank_budget'])}): shard, FSDP2 "
        "(ZeRO-3), with bf16 or checkpointing when sharding alone is not enough. Here "
        + (f"{', '.join(part_fit)} fit; {_fewest(part_fit, comm, f['use_when']['part_budget'], f['pays'])}" if part_fit else
           "no point fits that budget")
        + ".")
    ratio = f["tensor_parallel_comm"] / f["pipeline_sent_max"] if f["pipeline_sent_max"] else float("inf")
    lines.append(
        f"many GPUs (more than {gpus_per_node}, several machines): tensor parallelism inside a machine, pipeline stages "
        f"across machines. Here a tensor-parallel rank sent {format_bytes(f['tensor_parallel_comm'])} per step, "
        f"{ratio:.1f}x what the busiest rank of chapter 06's model-parallel split sent "
        f"({format_bytes(f['pipeline_sent_max'])}: its boundary sends and the tied weight's all-reduce)"
        + (": per step it needs the faster link, NVLink inside a machine (both ran over loopback here: this run "
           "counted the bytes, it did not compare links)" if ratio > 1 else
           ": at this model's size it did not move more; the rule rests on larger layers, whose all-reduces grow "
           "with the width while a boundary sends one activation"))
    theory = f.get("bubble_theory") or {}
    lines.append(
        "  a pipeline's stages wait for each other. The measured idle share (bubble) against M micro-batches per "
        "step, with chapter 06b's theory, (K-1)/(M+K-1) for K stages, in brackets; the measured times include time "
        "outside the compute, which the theory leaves out (chapter 06b explains it):")
    for schedule, bubble in f["bubble_by_microbatches"].items():
        ms = sorted(bubble)
        each = ", ".join(f"M={m}: {bubble[m]:.3f}" + (f" ({theory[m]:.3f})" if m in theory else "") for m in ms)
        trend = f["bubble_trend"].get(schedule)
        lines.append(f"    {schedule}: {each}" + (f"; chapter 06b's verdict, by its timed steps' spread: it {trend}"
                                                    if trend else ""))
    lines.append(
        f"  splitting the model over {f['model_parallel_ranks']} ranks left at most "
        f"{format_bytes(f['model_parallel_peak_max'])} per rank, against {format_bytes(f['plain_peak'])} on one device.")
    return lines


NEAR = 1.25  # a prediction within this factor of a measured ratio (either way) is near it; else "neither"


def _launches_ratio(before: dict, after: dict, gpu: str) -> float:
    """Return the with-launches time ratio of two work records on `gpu` (StepTime.with_launches_s)."""
    b, a = (step_time(work_from_record(w), gpu) for w in (before, after))
    return a.with_launches_s / b.with_launches_s


def gpu_run_rows(run: dict) -> list[dict]:
    """Return one row per step the recorded GPU run timed against a plain one: its measured time ratio there, the
    roofline's ratio on that GPU from the same counted work (the work alone), and that ratio with the host's launches
    counted (`launches`, StepTime.with_launches_s: where both steps' launches outlast their work, the ratio of their
    operators; chapter 03's `gpu_step_time_ratio_half_launches` where recorded, else from the work records)."""
    rows = []
    m1, m3, m5 = (_m(run, s) for s in ("01_gradient_accumulation", "03_mixed_precision", "05_layer_to_layer"))
    gpu = m3["gpu"]  # the GPU every chapter of the run projected onto (GPU="auto": the one it ran on)
    works = _by_int_key(m1["work_by_accum_steps"])
    measured = _by_int_key(m1["step_time_ratio_by_accum_steps"])
    roofline = _by_int_key(m1["gpu_step_time_ratio_by_accum_steps"])
    for k in sorted(k for k in works if k > 1):
        rows.append({"technique": f"accumulation k={k}", "measured": measured[k], "roofline": roofline[k],
                     "launches": _launches_ratio(works[1], works[k], gpu)})
    rows.append({"technique": f"{m3['half_precision']} autocast", "measured": 1 / m3["throughput_ratio_half"],
                 "roofline": m3["gpu_step_time_ratio_half"],
                 "launches": m3.get("gpu_step_time_ratio_half_launches")
                 or _launches_ratio(m3["work_fp32"], m3["work_half"], gpu)})
    rows.append({"technique": "layer-to-layer", "measured": m5["step_time_ratio_l2l"],
                 "roofline": m5["gpu_step_time_ratio_l2l"],
                 "launches": _launches_ratio(m5["work_plain"], m5["work_l2l"], gpu)})
    for r in rows:  # which of the two counted figures the measurement sits nearer, if either is near it
        off = {k: abs(math.log(r[k] / r["measured"])) for k in ("launches", "roofline")}
        nearest = min(off, key=off.get)
        r["nearer"] = nearest if off[nearest] <= math.log(NEAR) else "neither"
    return rows


def _projection_scores(rows: list[dict]) -> dict:
    """Return, per projection of gpu_run_rows' `rows` ("launches", "roofline"): how many measured steps lay nearer it
    than the other, how many within NEAR of it, and how many went its way (faster or slower than the plain step)."""
    def off(r, k):
        return abs(math.log(r[k] / r["measured"]))
    other = {"launches": "roofline", "roofline": "launches"}
    return {k: {"nearer": sum(off(r, k) < off(r, other[k]) for r in rows),
                "within": sum(off(r, k) <= math.log(NEAR) for r in rows),
                "way": sum((r[k] > 1) == (r["measured"] > 1) for r in rows)} for k in other}


def supported_projection(rows: list[dict]) -> str | None:
    """Return the projection of gpu_run_rows' `rows` the measured steps support ("launches" or "roofline": nearer more
    often, then the way they went more often), None where neither leads (chapters 08, 10)."""
    score = {k: (v["nearer"], v["way"]) for k, v in _projection_scores(rows).items()}
    return None if score["launches"] == score["roofline"] else max(score, key=score.get)


def ranking_line(rows: list[dict], source: str) -> str:
    """Say which projection of gpu_run_rows' `rows`, the work alone or with the host's launches, the measured steps
    lay nearer and went the way of (faster or slower than the plain step): the ranking to read (chapters 08, 10)."""
    s = _projection_scores(rows)
    launches, work = s["launches"], s["roofline"]
    text = (f"which projection to read: on the GPU run in {source}, {launches['nearer']} of {len(rows)} timed steps "
            f"lay nearer the with-launches prediction (within {NEAR:.2f}x of it for {launches['within']}; the work "
            f"alone: nearer for {work['nearer']}, within {NEAR:.2f}x for {work['within']}), and {launches['way']} were "
            f"faster or slower than the plain step as it predicted ({work['way']} as the work alone predicted)")
    lead = supported_projection(rows)
    if lead == "launches":
        return (text + ": at this size read the with-launches figures; the work alone sets the pace once each kernel "
                "takes longer than its launch (large models: chapter 09)")
    if lead == "roofline":
        return text + ": read the work-alone figures; the launches did not set these steps' pace"
    return text + ": neither projection leads; read both"


def launch_reading(launch_order: list[dict], tolerance: float = TIME_TOLERANCE, gpu_rows: list | None = None) -> str:
    """Say what the with-launches order (with_launches_order) advises: which comes first, and which rows make the
    step slower than the plain one so counted (chapter 10, where the measured run supports that reading); with the
    GPU run's `gpu_rows`, how far that projection missed its host-link step (L2L) where 04 or 05 leads."""
    lead = launch_order[0]
    with_ = ties(launch_order, tolerance)[lead["technique"]]
    slower = [r for r in launch_order if r["time_ratio_launches"] > 1 + tolerance]
    notes = [f"{lead['time_ratio_launches']:.2f}x the plain step's time"
             + (f", tied with {', '.join(launch_order[p - 1]['technique'] for p in with_)}" if with_ else "")]
    timed = {chapter(stem) for stem in GPU_RUN_RECORDS}  # the chapters whose steps the GPU run timed (01, 03, 05)
    leads = [lead] + [launch_order[p - 1] for p in with_]
    untimed = [r["chapter"] for r in leads if r["chapter"] not in timed]
    if untimed:
        notes.append(f"chapter{'s' if len(untimed) > 1 else ''} {' and '.join(untimed)} not timed on the GPU run")
    host_link = [r["chapter"] for r in leads if r["chapter"] in ("04", "05")]
    l2l = next((r for r in gpu_rows or [] if r["technique"] == "layer-to-layer"), None)
    if host_link and l2l:  # copies over the host link: the launches' projection is weakest there
        notes.append(f"{' and '.join(host_link)} cop{'y' if len(host_link) > 1 else 'ies'} over the host link, where "
                     f"the GPU run's layer-to-layer measured {l2l['measured']:.2f}x against {l2l['launches']:.2f}x with "
                     "launches: an uncertain place")
    text = f"read so, {lead['technique']} comes first ({'; '.join(notes)})"
    if len(slower) == len(launch_order):
        return text + "; every technique makes the step slower than the plain one at this size: each adds kernels"
    if slower:
        return text + f"; slower than the plain step so counted: {', '.join(r['technique'] for r in slower)}"
    return text


def held_line(run: dict, technique: str) -> str:
    """Say how the recorded GPU `run` timed gpu_run_rows' step `technique` (e.g. "bf16 autocast") against its two
    projections, and which one's direction held (chapter 03)."""
    r = next(row for row in gpu_run_rows(run) if row["technique"] == technique)
    held = "the launches'" if _projection_scores([r])["launches"]["nearer"] else "the work's"
    return (f"which to believe: on the recorded {(cuda_gpu_key(run['hardware']) or 'GPU').upper()} run (chapter 10) "
            f"the {technique} step took {r['measured']:.2f}x the plain step's time (by the work {r['roofline']:.2f}x, "
            f"with launches {r['launches']:.2f}x): {held} projection lay nearer, and measured, the step ran "
            + ("slower than the plain one: at this size it saves memory, not time" if r["measured"] > 1 else
               "faster than the plain one"))


def train_at_this_size(launch_ratios: dict, same_speed: float, recorded: str | Path = GPU_RUN_PATH) -> tuple | None:
    """Return (the fastest setting counting the host's launches, those tied with it) where some setting beats chapter
    08's answer so counted (`launch_ratios`: name -> its with-launches time over the answer's; `same_speed`: the tie
    margin) and the recorded GPU run supports the launches' projection; else None (then train the answer)."""
    if not any(r < same_speed for r in launch_ratios.values()):
        return None
    if supported_projection(gpu_run_rows(measured_run(None, recorded)[0])) != "launches":
        return None
    quickest = min(launch_ratios, key=launch_ratios.get)
    tied = [n for n, r in launch_ratios.items() if n != quickest and r * same_speed <= launch_ratios[quickest]]
    return quickest, tied


def search_launch_lines(speedup: float, speedup_launches: float, launch_ratios: dict, same_speed: float,
                        recorded: str | Path = GPU_RUN_PATH) -> list[str]:
    """Return chapter 08's lines on the host's launches: its answer's speed-up over the plain step by the work alone
    (`speedup`) and with launches; which chapter settings beat or tie it so counted (`launch_ratios`: name -> its
    with-launches time over the answer's; `same_speed`: the tie margin); which projection the recorded GPU run
    supports; and, where it supports the launches', the setting to train at this size (train_at_this_size)."""
    ahead = [n for n, r in launch_ratios.items() if r < same_speed]
    tied = [n for n, r in launch_ratios.items() if same_speed <= r < 1 / same_speed]
    lines = [f"by counted work alone the search's answer runs at {speedup:.2f}x the plain step's speed; counting the "
             f"host's launches (an H200 host's rate), which set the pace at this size, at {speedup_launches:.2f}x: "
             + (f"behind {', '.join(ahead)}" if ahead else f"tied with {', '.join(tied)} (under {1 / same_speed:.3f}x "
                                                           "apart)" if tied else "still ahead")]
    run, source = measured_run(None, recorded)
    lines.append(ranking_line(gpu_run_rows(run), source))
    if (pick := train_at_this_size(launch_ratios, same_speed, recorded)) is not None:
        quickest, tied_q = pick
        tie = f"; tied with {', '.join(tied_q)}, within the {1 / same_speed:.3f}x tie margin" if tied_q else ""
        timed = {chapter(stem) for stem in GPU_RUN_RECORDS}  # the chapters whose steps the GPU run timed
        untimed = [n.split(" ", 1)[0] for n in (quickest, *tied_q) if n.split(" ", 1)[0] not in timed]
        lines.append(f"read so, train {quickest} at this size ({launch_ratios[quickest]:.2f}x the answer's time{tie}"
                     + (f"; {' and '.join(untimed)} not timed on that GPU run" if untimed else "") + "); the "
                     "search's answer sets the pace once launches cost little: a larger model, or launches hidden "
                     "(CUDA graphs)")
    return lines


# what gpu_run_rows reads from a run: each technique's measured step-time ratio and the work it was counted from
GPU_RUN_RECORDS = {
    "01_gradient_accumulation": ("work_by_accum_steps", "step_time_ratio_by_accum_steps",
                                 "gpu_step_time_ratio_by_accum_steps"),
    "03_mixed_precision": ("gpu", "half_precision", "throughput_ratio_half", "gpu_step_time_ratio_half", "work_fp32",
                           "work_half"),
    "05_layer_to_layer": ("step_time_ratio_l2l", "gpu_step_time_ratio_l2l", "work_plain", "work_l2l"),
}


def cuda_gpu_key(hardware: str) -> str | None:
    """Return the labkit.gpus key a run's hardware line names, "h200" for "cuda: NVIDIA H200, ..." (chapter 10)."""
    if not hardware.startswith("cuda"):
        return None
    parts = sorted(((p, k) for k, ps in CUDA_NAMES.items() for p in ps), key=lambda x: -len(x[0]))  # "A100" before "A10"
    return next((k for p, k in parts if p in hardware), None)


def timed_on_its_gpu(results: dict | None) -> bool:
    """Return whether `results` timed chapters 01, 03 and 05 on a CUDA device and projected onto it (chapter 10)."""
    notebooks = (results or {}).get("notebooks", {})
    for stem, keys in GPU_RUN_RECORDS.items():
        entry = notebooks.get(stem) or {}
        if entry.get("status") != "ok" or any(k not in entry.get("measurements", {}) for k in keys):
            return False
    gpu = cuda_gpu_key(str(results.get("hardware", "")))
    return gpu is not None and gpu == _m(results, "03_mixed_precision")["gpu"]


def measured_run(results: dict | None, recorded: str | Path = GPU_RUN_PATH) -> tuple[dict, str]:
    """Return the GPU run to set beside the predictions and where it comes from: `results` when timed_on_its_gpu,
    else the project's recorded run (chapter 10)."""
    if timed_on_its_gpu(results):
        return results, "this page's results.json, named above"
    return json.loads(Path(recorded).read_text()), f"labkit/data/{Path(recorded).name}"


def gpu_run_lines(run: dict, rows: list[dict], source: str = f"labkit/data/{GPU_RUN_PATH.name}") -> list[str]:
    """Return a GPU run's table: where it ran and which file holds it, then one line per row of gpu_run_rows."""
    when = run["generated_utc"][:10]
    lines = [f"recorded {when}: {run['hardware']} ({source}); each step's time over the plain step's", f"{'step':24s} {'measured':>9s} {'roofline':>9s} {'with launches':>14s}  within {NEAR:.2f}x of it"]
    for r in rows:
        lines.append(f"{r['technique']:24s} {r['measured']:>8.2f}x {r['roofline']:>8.2f}x {r['launches']:>13.2f}x  "
                     f"{r['nearer']}")
    return lines
