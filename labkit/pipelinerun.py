"""A measured pipeline run read back (chapters 06 and 06b): the actions inside each rank's timed spans, the bubble
they leave, the micro-batches each stage holds, the step on a GPU with the bubble, and what the measured bubbles say
over M in words (the ideal schedules and the replay: labkit.techniques.pipeline)."""

from __future__ import annotations

import dataclasses

from labkit.stages import ACTION_KINDS, LOSS_KIND
from labkit.techniques.pipeline import ideal_schedule, replay

BUBBLE_LEVEL = 0.005  # two bubble fractions closer than this count as level in a trend sentence (chapters 06b, 10)


def actions_within(spans: list, window: str, core_waits: list | None = None) -> list[tuple[str, float, float]]:
    """Return the pipeline actions ("F…", "B…", "W…") of a rank's spans inside the span labelled `window`.

    core_waits: the rank's RankResult.core_waits; given, each action is shortened by its rank's waits for a core.
    """
    if core_waits is not None and len(core_waits) != len(spans):
        raise ValueError(f"core_waits needs one entry per span ({len(spans)}), got {len(core_waits)}")
    waits = core_waits if core_waits is not None else [0.0] * len(spans)
    frames = [(a, b) for label, a, b in spans if label == window]
    if len(frames) != 1:
        raise ValueError(f"expected one span labelled {window!r}, found {len(frames)}")
    lo, hi = frames[0]
    inside = [(label, float(a), float(b), float(w)) for (label, a, b), w in zip(spans, waits)
              if label[:1] in (*ACTION_KINDS, LOSS_KIND) and label != window and lo <= a and b <= hi]
    out, forward_at = [], {}
    for label, a, b, w in inside:
        if label[0] == LOSS_KIND and ("F" + label[1:]) in forward_at:  # the loss ends its micro-batch's forward
            i = forward_at["F" + label[1:]]
            f_label, f_a, f_b, f_w = out[i]
            out[i] = (f_label, f_a, b, f_w + w)
            continue
        if label[0] == "F":
            forward_at[label] = len(out)
        out.append((label, a, b, w))
    return [(label, a, b - w) for label, a, b, w in out]


def measured_bubble(actions_by_rank: dict[int, list]) -> dict:
    """Return the makespan, each rank's busy seconds and the bubble fraction of measured actions."""
    actions = {r: [(label, float(a), float(b)) for label, a, b in acts] for r, acts in actions_by_rank.items()}
    if not actions or not all(actions.values()):
        raise ValueError("every rank needs at least one F/B/W action")
    start = min(a for acts in actions.values() for _, a, _ in acts)
    end = max(b for acts in actions.values() for _, _, b in acts)
    busy = {r: sum(b - a for _, a, b in acts) for r, acts in actions.items()}
    makespan = end - start
    return {"makespan_s": makespan, "busy_s": busy,
            "bubble_fraction": 1.0 - sum(busy.values()) / (len(actions) * makespan)}


def fit_inverse_m(ms: list[int], values: list[float]) -> tuple[float, float]:
    """Fit values ≈ a + b/M by least squares; return (a, b) (chapter 06b)."""
    import statistics

    line = statistics.linear_regression([1 / m for m in ms], values)
    return line.intercept, line.slope


@dataclasses.dataclass
class HeldCounts:
    """Micro-batches each stage holds at its activation peak, and the fit's parts, by stage (chapter 06b)."""

    held: dict  # {schedule: {M: [micro-batches held, by stage]}}
    fixed_bytes: list  # c_s: what does not depend on M (1F1B's a in a + b/M)
    working_bytes: list  # t_s: one micro-batch's working memory is t_s / M (GPipe's b)
    fit_saved_bytes: list  # A_s from the fits: GPipe's a less 1F1B's

    def modelled_bytes(self, saved_bytes: list, points: dict) -> dict:
        """Return c_s + (h·A_s + t_s)/M by schedule, M and stage with the counts built in (GPipe h = M, 1F1B
        h = K − s) and A_s metered (`saved_bytes`): what the metered peaks are set against."""
        k = len(saved_bytes)
        return {name: {m: [self.fixed_bytes[s] + ((m if name == "GPipe" else k - s) * saved_bytes[s]
                                                  + self.working_bytes[s]) / m for s in range(k)] for m in ms}
                for name, ms in points.items()}


def micro_batches_held(peaks: dict, points: dict, saved_bytes: list) -> HeldCounts:
    """Count the micro-batches held from activation peaks {schedule: {M: [bytes by stage]}} (chapter 06b).

    points: {"GPipe": [M...], "1F1B": [M...]}; saved_bytes: A_s by stage, the whole batch's saved activations
    metered apart. A peak is c_s + (h·A_s + t_s)/M with GPipe's h = M: fitting a + b/M to each schedule gives c_s
    (1F1B's a) and t_s (GPipe's b), then h = (peak − c_s − t_s/M)·M/A_s at every point.
    """
    held = {name: {m: [] for m in ms} for name, ms in points.items()}
    fixed, working, fit_saved = [], [], []
    for s, saved in enumerate(saved_bytes):
        a_gpipe, t_s = fit_inverse_m(points["GPipe"], [peaks["GPipe"][m][s] for m in points["GPipe"]])
        c_s, _ = fit_inverse_m(points["1F1B"], [peaks["1F1B"][m][s] for m in points["1F1B"]])
        fixed.append(c_s)
        working.append(t_s)
        fit_saved.append(a_gpipe - c_s)
        for name, ms in points.items():
            for m in ms:
                held[name][m].append((peaks[name][m][s] - c_s - t_s / m) * m / saved)
    return HeldCounts(held, fixed, working, fit_saved)


def step_with_bubble_s(rows: list, updates: list, micro_batches: int, gpu, launches: bool = False) -> float:
    """Return one pipeline step on `gpu` (chapter 06b) from each stage's counted step (`rows`, labkit.work.Work) and
    the optimizer update inside it (`updates`): forward and backward stretched by the bubble, (M + K − 1)/M with equal
    stages and free sends, then the update once; the slowest stage's. `launches`: with the host's launches counted."""
    from labkit.gpus import step_time

    def seconds(work) -> float:
        on = step_time(work, gpu)
        return on.with_launches_s if launches else on.time_s

    stretch = (micro_batches + len(rows) - 1) / micro_batches
    return max((seconds(row) - seconds(up)) * stretch + seconds(up) for row, up in zip(rows, updates))


@dataclasses.dataclass
class PipelineTimings:
    """A pipeline launch's timed steps, read from its ranks' spans "<schedule> M=<m> #<t>" (chapter 06b).

    ranks: labkit.dist.launch's RankResults (rank, spans, core_waits); steps: timed steps per point.
    """

    ranks: list
    steps: int

    def actions(self, schedule: str, micro_batches: int, compute_only: bool = False) -> list[dict[int, list]]:
        """Return each timed step's actions by rank; compute_only: each action less its rank's waits for a core."""
        return [{r.rank: actions_within(r.spans, f"{schedule} M={micro_batches} #{t}",
                                        r.core_waits if compute_only else None) for r in self.ranks}
                for t in range(self.steps)]

    def bubbles(self, schedule: str, micro_batches: int) -> list[float]:
        """Return the measured bubble fraction of each timed step."""
        return [measured_bubble(s)["bubble_fraction"] for s in self.actions(schedule, micro_batches)]

    def median_step(self, schedule: str, micro_batches: int) -> tuple[float, int]:
        """Return the median measured bubble of a point's timed steps, and the index of the step closest to it."""
        import statistics

        fractions = self.bubbles(schedule, micro_batches)
        median = statistics.median(fractions)
        return median, min(range(len(fractions)), key=lambda t: abs(fractions[t] - median))

    def replayed_bubble(self, schedule: str, micro_batches: int) -> float:
        """Return the median bubble of the timed steps replayed on their compute only (waits for a core out)."""
        import statistics

        return statistics.median(measured_bubble(replay(s))["bubble_fraction"]
                                 for s in self.actions(schedule, micro_batches, compute_only=True))

    def makespans_s(self, schedule: str, micro_batches: int) -> list[tuple[float, float, float]]:
        """Return per timed step: the measured step, its replay with whole spans, its compute-only replay (seconds)."""
        return [(measured_bubble(s)["makespan_s"], measured_bubble(replay(s))["makespan_s"],
                 measured_bubble(replay(c))["makespan_s"])
                for s, c in zip(self.actions(schedule, micro_batches),
                                self.actions(schedule, micro_batches, compute_only=True))]

    def step_parts_s(self, schedule: str, micro_batches: int) -> tuple[float, float, float]:
        """Return the median timed step's seconds (the step of median length) in three parts that add up to it: the
        compute-only replay, the waits for a core inside actions, and the time between actions (sends, receives,
        the schedule's bookkeeping)."""
        spans = sorted(self.makespans_s(schedule, micro_batches))
        s, w, c = spans[(len(spans) - 1) // 2]  # the lower middle of an even count: a step that ran
        return c, w - c, s - w

    def bubble_parts(self, schedule: str, micro_batches: int) -> tuple[float, float, float]:
        """Return the median timed step's measured bubble (median_step's) in three parts that add up to it: the
        compute-only replay's bubble, what the waits for a core inside actions add (the whole-span replay's bubble
        less it), and what the time between actions adds (the measured bubble less the whole-span replay's)."""
        t = self.median_step(schedule, micro_batches)[1]
        step = self.actions(schedule, micro_batches)[t]
        measured, whole, compute = (measured_bubble(x)["bubble_fraction"] for x in (
            step, replay(step), replay(self.actions(schedule, micro_batches, compute_only=True)[t])))
        return compute, whole - compute, measured - whole

    def per_action_s(self, schedule: str, micro_batches: int) -> tuple[float, float, float]:
        """Return per action (seconds, medians over steps): compute, the step's waits for a core, between actions."""
        import statistics

        steps = self.actions(schedule, micro_batches)
        n = len(next(iter(steps[0].values())))  # actions per rank: 2M, or 4M with two stages per rank
        compute = [sum(measured_bubble(c)["busy_s"].values()) / (len(c) * n)
                   for c in self.actions(schedule, micro_batches, compute_only=True)]
        parts = [(w - c, s - w) for s, w, c in self.makespans_s(schedule, micro_batches)]
        return (statistics.median(compute), statistics.median(p[0] / n for p in parts),
                statistics.median(p[1] / n for p in parts))

    def ideal_bubble_with_stage_times(self, schedule: str, micro_batches: int) -> float:
        """Return the median bubble of the ideal schedule fed each stage's median forward and backward seconds of
        a compute-only replay: what unequal stages alone imply (one stage per rank)."""
        import statistics

        fractions = []
        for s in self.actions(schedule, micro_batches, compute_only=True):
            plan = replay(s)
            t_f = [statistics.median(b - a for label, a, b in plan[r] if label[0] == "F") for r in sorted(plan)]
            t_b = [statistics.median(b - a for label, a, b in plan[r] if label[0] == "B") for r in sorted(plan)]
            fractions.append(measured_bubble(ideal_schedule(schedule, len(plan), micro_batches, t_f, t_b))
                             ["bubble_fraction"])
        return statistics.median(fractions)

    def bubble_range(self, schedule: str, micro_batches: int) -> tuple[float, float]:
        """Return the lowest and highest measured bubble of a point's timed steps."""
        fractions = self.bubbles(schedule, micro_batches)
        return min(fractions), max(fractions)

    def rise_told(self, schedule: str, m_from: int, m_to: int) -> bool:
        """Tell whether the bubble's rise from M = m_from to m_to lies beyond both points' spread of timed steps."""
        return self.steps >= 2 and self.bubble_range(schedule, m_from)[1] < self.bubble_range(schedule, m_to)[0]

    def verdict(self, schedule: str, ms: list[int], bubbles: list[float]) -> BubbleVerdict:
        """Return what the measured bubbles (medians, by M in `ms`) show: describe_bubble's trend and, where they rise
        after the lowest M, whether that rise is a finding (beyond the timed steps' spread, and not mostly waits for
        a core), with its split into replay, core waits and time between actions (chapter 06b)."""
        low = bubbles.index(min(bubbles))
        words = describe_bubble(ms, bubbles, [self.bubble_range(schedule, m) for m in ms])
        if low == len(ms) - 1 or bubbles[-1] <= bubbles[low] + BUBBLE_LEVEL:
            return BubbleVerdict(words, None, None, {}, None)
        (r0, c0, b0), (r1, c1, b1) = (self.bubble_parts(schedule, m) for m in (ms[low], ms[-1]))
        parts = {"replay": (r0, r1), "core waits": (c0, c1), "between actions": (b0, b1)}  # what the rise is made of
        shares = {k: b - a for k, (a, b) in parts.items()}
        why_not = ("within the steps' spread" if not self.rise_told(schedule, ms[low], ms[-1]) else
                   "mostly core waits" if max(shares, key=shares.get) == "core waits" else None)
        told = why_not is None
        words = (words if told else words.split(", then rises")[0]) + (
            f" (M = {ms[low]} -> {ms[-1]}, {bubbles[low]:.3f} -> {bubbles[-1]:.3f}: {'a rise' if told else why_not})")
        return BubbleVerdict(words, told, why_not, parts, (ms[low], ms[-1]))

    def schedules_compared(self, ms: list[int], measured: dict) -> str:
        """Return at how many of `ms` (both schedules timed there) 1F1B's timed steps lie below or above GPipe's, how
        far their replays are apart, and each one's median time between actions (chapter 06b); `measured`: {schedule:
        {M: median bubble}}."""
        import statistics

        lower, higher = (sum(self.bubble_range(a, m)[1] < self.bubble_range(b, m)[0] for m in ms)
                         for a, b in (("1F1B", "GPipe"), ("GPipe", "1F1B")))  # M where the steps' ranges lie apart
        between_ms = {name: statistics.median(self.per_action_s(name, m)[2] * 1e3 for m in ms)
                      for name in ("GPipe", "1F1B")}
        rep_gap = max(abs(self.replayed_bubble("1F1B", m) - self.replayed_bubble("GPipe", m)) for m in ms)
        beyond = lower == len(ms) and min(measured["GPipe"][m] - measured["1F1B"][m] for m in ms) > rep_gap
        return (f"ranges apart, 1F1B's measured bubble is below GPipe's at {lower} of {len(ms)} M, above at {higher}; "
                f"their replays at most {rep_gap:.3f} apart"
                + (": the difference lies outside compute" if beyond else "")
                + f" (time between actions, median per action: GPipe {between_ms['GPipe']:.2f} ms, "
                f"1F1B {between_ms['1F1B']:.2f})")


@dataclasses.dataclass
class BubbleVerdict:
    """What chapter 06b says of one schedule's measured bubble over M (PipelineTimings.verdict)."""

    words: str  # the trend, level where the timed steps' spreads overlap, and the verdict on a rise
    rise_told: bool | None  # None: no rise after the lowest M; True: the rise is a finding
    why_not: str | None  # why a rise is no finding: "within the steps' spread" or "mostly core waits"
    # the rise in the median timed step's three shares of the step (bubble_parts), each at the two M of `rise_ms`:
    # {"replay": (from, to), "core waits": (from, to), "between actions": (from, to)}; {} without a rise
    parts: dict[str, tuple[float, float]]
    rise_ms: tuple[int, int] | None  # the lowest median's M and the last M (None without a rise)

    def parts_rows(self) -> list[tuple]:
        """Return the rise's three shares as table rows (labkit.print_rows): a header, each share at the two M and its
        change, their sum (the median timed step's bubble); [] without a rise."""
        if not self.parts:
            return []
        (m0, m1), parts = self.rise_ms, self.parts
        return ([("", f"M = {m0}", f"M = {m1}", "change")]
                + [(part, f"{a:.3f}", f"{b:.3f}", f"{b - a:+.3f}") for part, (a, b) in parts.items()]
                + [("the bubble (their sum)", *(f"{sum(p[i] for p in parts.values()):.3f}" for i in (0, 1)),
                    f"{sum(b - a for a, b in parts.values()):+.3f}")])


RISE_PARTS = ("the median timed step's bubble in three shares of the step: its own replay (not the table's median of "
              "every step's), core waits (the replay with each action's whole span less the replay with compute alone, "
              "below 0 where a wait fills what would be idle), the time between actions")
"""What BubbleVerdict.parts_rows' table holds, in words (chapter 06b prints it above the tables)."""


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def level_stretch(bubbles: list[float], ranges: list[tuple[float, float]]) -> tuple[int, int]:
    """Return the first and last index of the stretch around the lowest median whose (low, high) ranges all overlap
    pairwise: the points no measurement tells apart (chapter 06b)."""
    low = min(range(len(bubbles)), key=lambda k: (bubbles[k], k))
    first = last = low
    while first > 0 and all(_overlap(ranges[first - 1], ranges[k]) for k in range(first, last + 1)):
        first -= 1
    while last < len(ranges) - 1 and all(_overlap(ranges[last + 1], ranges[k]) for k in range(first, last + 1)):
        last += 1
    return first, last


def _rise_after(ranges: list[tuple[float, float]], first: int, last: int) -> int | None:
    """Return the stretch's index whose range the next point's lies wholly above (the lowest such high), if any."""
    if last == len(ranges) - 1:
        return None
    below = [k for k in range(first, last + 1) if ranges[k][1] < ranges[last + 1][0]]
    return min(below, key=lambda k: ranges[k][1]) if below else None


def _beside(ranges: list[tuple[float, float]], first: int, last: int) -> tuple[list[int], list[int]]:
    """Return the stretch's indices whose range the next point's overlaps, and those it lies wholly below."""
    nxt = ranges[last + 1]
    return ([k for k in range(first, last + 1) if _overlap(nxt, ranges[k])],
            [k for k in range(first, last + 1) if nxt[1] < ranges[k][0]])


def _spreads(ms: list[int], ranges: list[tuple[float, float]], indices: list[int]) -> str:
    """Return "M = 4's (0.245-0.284) and M = 8's (0.198-0.267)": the points' timed steps' ranges, named."""
    return " and ".join(f"M = {ms[j]}'s ({ranges[j][0]:.3f}-{ranges[j][1]:.3f})" for j in indices)


def _pairwise(ranges: list[tuple[float, float]]) -> bool:
    return all(_overlap(a, b) for a in ranges for b in ranges)


def describe_bubble(ms: list[int], bubbles: list[float], ranges: list[tuple[float, float]],
                    tol: float = BUBBLE_LEVEL) -> str:
    """Say how measured bubbles move over M: level only where every pair of timed steps' ranges overlaps, a rise or
    fall only between points whose ranges do not (chapter 06b)."""
    from labkit.trend import describe_trend

    if all(lo == hi for lo, hi in ranges):  # one timed step each: no spread, the medians' own trend
        return describe_trend(ms, bubbles, x_name="M", tol=tol)
    first, last = level_stretch(bubbles, ranges)
    lo, hi = min(r[0] for r in ranges[first:last + 1]), max(r[1] for r in ranges[first:last + 1])
    level = (f"level within the timed steps' spread ({lo:.3f}-{hi:.3f}) from M = {ms[first]} to M = {ms[last]}"
             if last > first else f"its lowest, {bubbles[first]:.3f} at M = {ms[first]}")
    words = f"falls from {bubbles[0]:.3f} at M = {ms[0]} to {level}" if first > 0 else f"stays {level}"
    if last == len(ms) - 1:
        return words
    k, r = _rise_after(ranges, first, last), last + 1
    if k is None:  # the next point overlaps part of the stretch and lies below the rest: no trend told from it
        over, below = _beside(ranges, first, last)
        words += (f"; M = {ms[r]}'s steps ({ranges[r][0]:.3f}-{ranges[r][1]:.3f}) "
                  + (f"overlap {_spreads(ms, ranges, over)}, and " if over else "")
                  + f"lie below {_spreads(ms, ranges, below)}")
        if r == len(ms) - 1:
            return words
        return words + f"; after M = {ms[r]} the median " + describe_trend(ms[r:], bubbles[r:], x_name="M", tol=tol)
    over = _beside(ranges, first, last)[0]  # stretch points the risen one still overlaps
    words += (f", then rises to {bubbles[r]:.3f} at M = {ms[r]}, its steps ({ranges[r][0]:.3f}-{ranges[r][1]:.3f}) "
              f"above {_spreads(ms, ranges, [k])}"
              + (f", within {_spreads(ms, ranges, over)}" if over else ""))
    if r == len(ms) - 1:
        return words
    if _pairwise(ranges[r:]):
        return words + f", and stays within its spread to M = {ms[-1]}"
    return words + f"; after M = {ms[r]} the median " + describe_trend(ms[r:], bubbles[r:], x_name="M", tol=tol)


def bubble_shape(ms: list[int], bubbles: list[float], ranges: list[tuple[float, float]]) -> str:
    """Return describe_bubble's finding in a few words for a figure title, e.g. "falls, level M = 2-8, rises at
    M = 16" (chapter 06b)."""
    first, last = level_stretch(bubbles, ranges)
    parts = ["falls"] if first > 0 else []
    parts.append(f"level M = {ms[first]}-{ms[last]}" if last > first else f"lowest at M = {ms[first]}")
    k = _rise_after(ranges, first, last)
    if k is not None:
        over = _beside(ranges, first, last)[0]
        parts.append(f"rises at M = {ms[last + 1]}" + (f" (above M = {ms[k]} only)" if over else ""))
    elif last < len(ms) - 1:  # below part of the stretch, overlapping the rest (if any)
        over, below = _beside(ranges, first, last)
        parts.append(f"M = {ms[last + 1]} within M = {ms[over[-1]]}'s spread" if over
                     else f"M = {ms[last + 1]} below M = {ms[below[-1]]}")
    return ", ".join(parts)


def step_from_first_forward(spans_by_rank: dict[int, list], window: str = "step") -> tuple[dict, dict]:
    """Return each rank's spans inside `window`, cut to start at the first forward ("F") of any rank, and each
    rank's start offset: the seconds it entered the window before that forward, only waiting (chapter 06)."""
    inside = {}
    for r, spans in spans_by_rank.items():
        frames = [(a, b) for label, a, b in spans if label == window]
        if len(frames) != 1:
            raise ValueError(f"rank {r}: expected one span labelled {window!r}, found {len(frames)}")
        (lo, hi), = frames
        inside[r] = [(label, a, b) for label, a, b in spans if label != window and lo <= a and b <= hi]
    first = min((a for spans in inside.values() for label, a, _ in spans if label.startswith("F")), default=None)
    if first is None:
        raise ValueError(f"no forward span inside {window!r}")
    offsets = {r: max(first - min((a for _, a, _ in spans), default=first), 0.0) for r, spans in inside.items()}
    return {r: [(label, max(a, first), b) for label, a, b in spans if b > first] for r, spans in inside.items()}, offsets


def seconds_in(spans: list, *labels: str) -> float:
    """Return the seconds a rank's spans with these labels last in all (chapter 06)."""
    return sum(b - a for label, a, b in spans if label in labels)



def bubble_shapes(timings: PipelineTimings, points: dict, measured: dict, verdicts: dict, m_last: int) -> dict:
    """Return each schedule's measured bubble over M in words (bubble_shape; shape_words with one timed step), a rise
    only as its verdict says (chapter 06b's figure and summary); `points`: {schedule: its M}; `measured`: {schedule:
    {M: median bubble}}; `verdicts`: {schedule: BubbleVerdict}; `m_last`: the sweep's largest M."""
    from labkit.trend import shape_words
    shapes = {name: bubble_shape(ms, [measured[name][m] for m in ms], [timings.bubble_range(name, m) for m in ms])
              if timings.steps >= 2 else shape_words([measured[name][m] for m in ms], BUBBLE_LEVEL)
              for name, ms in points.items()}
    return shapes | {name: shapes[name].split(", rises")[0] + f", rise to M = {m_last}: "
                     + {"mostly core waits": "core waits"}.get(verdicts[name].why_not, "in spread")
                     for name in points if verdicts[name].rise_told is False and ", rises" in shapes[name]}


def draw_bubbles(timings: PipelineTimings, points: dict, ms_all: list[int], theory: dict, measured: dict,
                 replayed: dict, shapes: dict, colors: dict):
    """Return chapter 06b's figure: each schedule's measured bubble over M (bar: its timed steps' range) and its
    compute-only replay beside the formula (K-1)/(M+K-1), the two schedules drawn a little apart on M, the title
    giving each one's shape (`shapes`, bubble_shapes'); `points`: {schedule: its M}; `theory`: {M: formula};
    `measured`, `replayed`: {schedule: {M: bubble}}; `colors`: {schedule: colour}."""
    import textwrap

    from labkit import plots
    fig, ax = plots.new_figure(1, 1, width_in=6.0, height_in=3.4)
    m_last = ms_all[-1]
    plots.plot_series(ax, ms_all, {}, "micro-batches M (the two schedules drawn a little apart)",
                      "bubble fraction (idle share of the step)",
                      f"K = {len(timings.ranks)}, M = {m_last}: formula {theory[m_last]:.3f}, replay "
                      + ", ".join(f"{name} {replayed[name][m_last]:.3f}" for name in points) + "\n"
                      + "\n".join(textwrap.fill(f"{name} measured: {shapes[name]}", 60) for name in points), logx=True)
    ax.plot(ms_all, [theory[m] for m in ms_all], color="grey", lw=3, alpha=0.5, zorder=0,
            label="formula (K-1)/(M+K-1)")
    for name, marker, shift in (("GPipe", "o", 0.94), ("1F1B", "s", 1.06)):  # apart: one's bars not under the other's
        xs = [m * shift for m in points[name]]
        ys, spread = [measured[name][m] for m in points[name]], [timings.bubble_range(name, m) for m in points[name]]
        ax.errorbar(xs, ys, [[y - lo for y, (lo, _) in zip(ys, spread)], [hi - y for y, (_, hi) in zip(ys, spread)]],
                    marker=marker, color=colors[name], capsize=3, label=f"{name} measured (bar: its steps' range)")
        ax.plot(xs, [replayed[name][m] for m in points[name]], marker=marker, ls="--", mfc="none", color=colors[name],
                label=f"{name} replayed (compute only)")
    ax.set_ylim(0, 1.6 * max(max(theory.values()), *(max(v.values()) for v in replayed.values()),
                             *(timings.bubble_range(name, m)[1] for name, ms in points.items() for m in ms)))
    ax.legend(fontsize=7, ncols=2, loc="upper right")
    return fig
