"""The search's figures (chapter 08): a study's progress by trial, and the colours every figure of the chapter shares."""

from __future__ import annotations

from matplotlib.ticker import MaxNLocator
from optuna.trial import TrialState

from labkit.search.study import feasible

# Optuna's own colours (its timeline and `make dashboard`), one meaning each in every figure of chapter 08:
# blue fits the budget, light grey does not, red a trial that failed (its worker was killed)
STATE_COLOURS = {"COMPLETE": "tab:blue", "FAIL": "tab:red", "PRUNED": "tab:orange", "RUNNING": "tab:green",
                 "WAITING": "tab:gray"}
FIT_COLOURS = {True: STATE_COLOURS["COMPLETE"], False: "#cccccc"}  # fits the budget, does not
# one name and one look per kind of trial, in every figure of chapter 08: (face colour, edge colour); hollow: not run
KINDS = {"fits (metered)": (FIT_COLOURS[True], FIT_COLOURS[True]),
         "fits (predicted, not run here)": ("white", FIT_COLOURS[True]),
         "does not fit": (FIT_COLOURS[False], "#8c8c8c"),
         "failed": (STATE_COLOURS["FAIL"], STATE_COLOURS["FAIL"]),
         "pruned": (STATE_COLOURS["PRUNED"], STATE_COLOURS["PRUNED"]),
         "running": (STATE_COLOURS["RUNNING"], STATE_COLOURS["RUNNING"]),
         "waiting": (STATE_COLOURS["WAITING"], STATE_COLOURS["WAITING"])}


def trial_kind(trial) -> str:
    """Return a speed trial's kind, a key of KINDS: whether it fits and was metered, or its state (chapter 08)."""
    if trial.state != TrialState.COMPLETE:
        return trial.state.name.lower().replace("fail", "failed")
    if not feasible(trial):
        return "does not fit"
    return "fits (predicted, not run here)" if trial.user_attrs.get("status") == "predicted" else "fits (metered)"


def speed_basis(speed_on: str) -> str:
    """Return where a speed comes from; a projection is by counted work alone, the host's launches left out (chapter 08)."""
    return f"{speed_on}, by counted work alone" if speed_on.startswith("projected") else speed_on


def speed_label(speed_on: str) -> str:
    """Return a speed axis's label, `speed_basis` in parentheses on its own lines (chapter 08)."""
    return "speed, x the plain step\n(" + speed_basis(speed_on).replace(", ", ",\n") + ")"


def draw_progress(fig, ax, trials, speed_on: str, order: str = "TPE") -> None:
    """Draw a speed study's progress on one axis: each finished trial's speed by its kind (KINDS) and the best that
    fits so far. `speed_on` says where speeds come from, `order` how settings were drawn (chapter 08)."""
    best, curve = 0.0, []
    for t in trials:
        if feasible(t):
            best = max(best, t.value)
        curve.append(best or float("nan"))
    ax.step([t.number for t in trials], curve, where="post", color="black", lw=1,
            label="best that fits so far" if best else None)  # a step: the best changes at a trial, not between
    #   two; no entry before a trial fits (it draws nothing yet)
    kinds = [trial_kind(t) for t in trials]
    for kind in ("fits (metered)", "fits (predicted, not run here)", "does not fit"):  # finished trials have a speed
        points = [t for t, k in zip(trials, kinds) if k == kind]
        if points:  # a legend entry only for a kind the study has
            ax.scatter([t.number for t in points], [t.value for t in points], s=16, facecolors=KINDS[kind][0],
                       edgecolors=KINDS[kind][1], label=kind)
    ax.axhline(1.0, color="#8c8c8c", lw=0.8, ls=":", label="the plain step's speed")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial"), ax.set_ylabel("speed, x the plain step")  # where it comes from: in the title
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=7, frameon=False)
    ax.set_title(f"Speed by trial ({order}) and the running best\n({speed_basis(speed_on)})", fontsize=9)


def draw_front(ax, trials, front, budget_bytes: int, speed_on: str) -> None:
    """Draw a speed study's finished trials by peak and speed, by their kind (KINDS), its Pareto `front`
    (studies.speed_memory_front) ringed in black, and the budget."""
    from labkit.meter import format_bytes
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value]
    for kind in ("fits (metered)", "fits (predicted, not run here)"):
        points = [t for t in done if trial_kind(t) == kind]
        if points:
            ax.scatter([t.user_attrs["peak_bytes"] / 2**20 for t in points], [t.value for t in points], s=18,
                       facecolors=KINDS[kind][0], edgecolors=KINDS[kind][1], label=kind)
    ax.axhline(1.0, color="#8c8c8c", lw=0.8, ls=":", label="the plain step's speed")
    ax.plot([t.user_attrs["peak_bytes"] / 2**20 for t in front], [t.value for t in front], "-o", ms=9, mfc="none",
            color="black", label="Pareto front (ringed)")  # a ring: the point's own kind shows inside it
    ax.axvline(budget_bytes / 2**20, color="black", ls="--", lw=1, label="budget")
    ax.set_xlabel("peak (MiB)"), ax.set_ylabel(speed_label(speed_on))
    ax.set_title(f"The front: {front[0].value:.2f}x the plain step at {format_bytes(front[0].user_attrs['peak_bytes'])} "
                 f"to {front[-1].value:.2f}x at {format_bytes(front[-1].user_attrs['peak_bytes'])}\n"
                 "(settings predicted over the budget have no speed)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the points, not over them


def label_lr_losses(ax, trials) -> None:
    """Name the lines of Optuna's intermediate-values plot (plot_intermediate_values) of a learning-rate study in
    chapter 08's words: coloured and listed by learning rate, smallest first; a pruned trial in × markers (dashed
    between them where it reported more than once)."""
    import matplotlib
    by_label = {f"Trial{t.number}": t for t in trials}
    lines = sorted(((by_label[l.get_label()], l) for l in ax.get_lines() if l.get_label() in by_label),
                   key=lambda tl: tl[0].params["lr"])
    shade = matplotlib.colormaps["viridis"]
    for i, (t, line) in enumerate(lines):
        colour = shade(0.9 * i / max(1, len(lines) - 1))  # one sequential map: the colour order is the lr order
        line.set_color(colour), line.set_markerfacecolor(colour), line.set_markeredgecolor(colour)
        pruned = t.state == TrialState.PRUNED
        line.set_label(f"lr {t.params['lr']:.1e}" + (" (pruned)" if pruned else ""))
        line.set_linestyle("--" if pruned else "-")
        line.set_marker("x" if pruned else "o")  # a pruned trial stopped at its first report is one point
    ax.legend(handles=[line for _, line in lines], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              title="smallest lr first", title_fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("Validation loss in each learning-rate trial (× markers: pruned, ending where it was stopped)",
                 fontsize=9)
    ax.set_xlabel("optimizer steps (the last step is never reported)"), ax.set_ylabel("validation loss")
