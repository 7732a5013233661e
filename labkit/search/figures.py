"""The search's figures (chapter 08): a study's progress by trial, and the colours every figure of the chapter shares."""

from __future__ import annotations

from matplotlib.ticker import MaxNLocator
from optuna.trial import TrialState

from labkit.search.study import feasible

# Optuna's own colours (its timeline and `make dashboard`), one meaning each in every figure of chapter 08:
# blue fits the budget, light grey does not (nothing ran), red a trial that failed (its worker was killed)
STATE_COLOURS = {"COMPLETE": "tab:blue", "FAIL": "tab:red", "PRUNED": "tab:orange", "RUNNING": "tab:green",
                 "WAITING": "tab:gray"}
FIT_COLOURS = {True: STATE_COLOURS["COMPLETE"], False: "#cccccc"}  # fits the budget, does not


def draw_progress(fig, axes, trials, speed_on: str, order: str = "TPE") -> None:
    """Draw a speed study's progress on two axes: each trial's speed (grey: did not fit; hollow: predicted to fit, not
    run here) with the best that fits so far, and the trials by state. `speed_on` says where speeds come from, `order`
    how the settings were drawn."""
    ax = axes[0]
    best, curve = 0.0, []
    for t in trials:
        if feasible(t):
            best = max(best, t.value)
        curve.append(best or float("nan"))
        if t.state == TrialState.COMPLETE:
            fits = t.constraints.get("peak_over_budget_bytes", 1) <= 0
            if t.user_attrs.get("status") == "predicted":
                ax.scatter(t.number, t.value, s=16, facecolors="none", edgecolors=FIT_COLOURS[True])
            else:
                ax.scatter(t.number, t.value, s=16, color=FIT_COLOURS[fits], edgecolors="#8c8c8c" if not fits else "none")
    ax.plot([t.number for t in trials], curve, color="black", lw=1, label="best that fits so far")
    ax.scatter([], [], s=16, color=FIT_COLOURS[True], label="fits (metered)")
    if any(t.user_attrs.get("status") == "predicted" for t in trials):
        ax.scatter([], [], s=16, facecolors="none", edgecolors=FIT_COLOURS[True], label="fits (predicted, not run)")
    ax.scatter([], [], s=16, color=FIT_COLOURS[False], edgecolors="#8c8c8c", label="does not fit (not run)")
    ax.axhline(1.0, color="#8c8c8c", lw=0.8, ls=":")
    ax.set_xlabel("trial"), ax.set_ylabel(f"speed, x the plain step\n({speed_on})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.18), ncol=4, frameon=False, columnspacing=1.0)
    ax.set_title(f"Speed by trial ({order}) and the running best", fontsize=9)
    states = [t.state.name if t.state != TrialState.COMPLETE else "DOES NOT FIT" if not feasible(t)
              else "FITS, NOT RUN" if t.user_attrs.get("status") == "predicted" else "FITS" for t in trials]
    bars = {"FITS": FIT_COLOURS[True], "FITS, NOT RUN": "#c6dbef", "DOES NOT FIT": FIT_COLOURS[False],
            "FAIL": STATE_COLOURS["FAIL"], "RUNNING": STATE_COLOURS["RUNNING"], "WAITING": STATE_COLOURS["WAITING"]}
    bars = {n: c for n, c in bars.items() if n in ("FITS", "DOES NOT FIT", "FAIL") or n in states}  # none: no bar
    axes[1].bar(list(bars), [states.count(n) for n in bars], color=list(bars.values()), edgecolor="#8c8c8c", lw=0.5)
    axes[1].tick_params(axis="x", labelsize=7, labelrotation=20)
    axes[1].yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[1].set_ylabel("trials"), axes[1].set_title("Trials by state\n(FAIL: its worker was killed; NOT RUN: 16-bit, "
                                                    "predicted)", fontsize=8)


def draw_front(ax, trials, front, budget_bytes: int, speed_on: str) -> None:
    """Draw a speed study's finished trials by peak and speed (hollow: predicted to fit, not run here), its Pareto
    `front` (studies.speed_memory_front) and the budget."""
    from labkit.meter import format_bytes
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.value]
    for guessed, style in ((False, dict(color=FIT_COLOURS[True], alpha=0.35, label="a trial that fits (metered)")),
                           (True, dict(facecolors="none", edgecolors=FIT_COLOURS[True],
                                       label="fits by its prediction (16-bit, not run here)"))):
        points = [t for t in done if (t.user_attrs.get("status") == "predicted") == guessed]
        if points:
            ax.scatter([t.user_attrs["peak_bytes"] / 2**20 for t in points], [t.value for t in points], s=18, **style)
    ax.axhline(1.0, color="#8c8c8c", lw=0.8, ls=":", label="the plain step's speed")
    ax.plot([t.user_attrs["peak_bytes"] / 2**20 for t in front], [t.value for t in front], "-o", ms=5,
            color="black", mfc=FIT_COLOURS[True], label="Pareto front")
    ax.axvline(budget_bytes / 2**20, color="black", ls="--", lw=1, label="budget")
    ax.set_xlabel("peak (MiB)"), ax.set_ylabel(f"speed, x the plain step\n({speed_on})")
    ax.set_title(f"The front: {front[0].value:.2f}x the plain step at {format_bytes(front[0].user_attrs['peak_bytes'])} "
                 f"to {front[-1].value:.2f}x at {format_bytes(front[-1].user_attrs['peak_bytes'])}\n"
                 "(settings predicted over the budget have no speed)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the points, not over them


def label_lr_losses(ax, trials) -> None:
    """Name the lines of Optuna's intermediate-values plot (plot_intermediate_values) of a learning-rate study in
    chapter 08's words: coloured and listed by learning rate, smallest first; a pruned trial dashed with × markers."""
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
    ax.set_title("Validation loss in each learning-rate trial (dashed, ×: pruned, ends where it was stopped)", fontsize=9)
    ax.set_xlabel("optimizer steps (the last step is never reported)"), ax.set_ylabel("validation loss")
