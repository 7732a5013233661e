"""Chapter 03's figures: loss curves of fp32 and 16-bit training side by side, and their step-by-step difference."""

from __future__ import annotations

from matplotlib.ticker import MaxNLocator

from labkit.plots import new_figure


def plot_loss_curves(curves: dict[str, list[float]], colors: dict[str, str], best_loss: float | None = None,
                     title: str = "", suptitle: str = ""):
    """Draw each precision's loss per step (fp32 wide and pale underneath) and each 16-bit curve minus fp32's (chapter 03).

    `curves`: {"fp32": losses, "bf16": losses, ...}, fp32 included; returns the figure.
    """
    if "fp32" not in curves:
        raise ValueError(f"curves need an 'fp32' entry to compare with, got {sorted(curves)}")
    fig, (ax, ax_diff) = new_figure(ncols=2, width_in=5.0, height_in=3.4)
    base = curves["fp32"]
    steps = range(1, len(base) + 1)
    for name, losses in curves.items():
        ax.plot(steps, losses, color=colors[name], label=name, **({"lw": 4, "alpha": 0.4} if name == "fp32" else {}))
        if name != "fp32":
            ax_diff.plot(steps, [a - b for a, b in zip(losses, base)], color=colors[name], label=f"{name} − fp32")
    if best_loss is not None:
        ax.axhline(best_loss, color="gray", ls=":", lw=1, label="best possible (entropy rate)")
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title=title or "Loss curves")
    ax_diff.axhline(0.0, color="gray", lw=0.8)
    ax_diff.set(xlabel="step", ylabel="loss difference (nats/token)", title="Difference from the fp32 curve")
    for a in (ax, ax_diff):
        a.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        a.title.set_fontsize(10)
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3)  # below the axes
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    return fig


def legend_used_categories(ax, splits: dict[str, dict[str, int]]) -> None:
    """Redraw a memory-bar legend without the categories that are zero in every bar (chapter 03)."""
    from labkit.meter import CATEGORIES

    unused = {cat.replace("_", " ") for cat in CATEGORIES if all(not split.get(cat, 0) for split in splits.values())}
    handles, labels = ax.get_legend_handles_labels()
    kept = [(h, label) for h, label in zip(handles, labels) if label not in unused]
    ax.legend(*zip(*kept), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def plot_step_memory_and_time(splits: dict[str, dict[str, int]], step_ms: dict[str, float], colors: dict[str, str],
                              gpu_name: str, memory_title: str = "", time_words: str = "counted",
                              work_ratio: float | None = None):
    """Draw each step's memory at its peak by category beside its time on a GPU, one bar per precision (chapter 03).

    `splits`: {"fp32 step": {category: bytes}, ...}; `step_ms`: {"fp32": ms, "bf16": ms}, fp32 first; `time_words`
    says what the times count (e.g. "roofline bound"); `work_ratio`, when given, is the last precision's time over
    fp32's by the counted work alone, titled beside the bars' ratio; returns the figure.
    """
    from labkit.plots import plot_memory_bars

    if "fp32" not in step_ms:
        raise ValueError(f"step_ms needs an 'fp32' entry to compare with, got {sorted(step_ms)}")
    names = list(step_ms)
    fig, (ax_mem, ax_time) = new_figure(ncols=2, width_in=4.6)
    plot_memory_bars(splits, ax=ax_mem, title=memory_title or "Memory at the step's peak")
    legend_used_categories(ax_mem, splits)  # beside the bars, never over them; no empty category
    bars = ax_time.bar(names, [step_ms[p] for p in names], color=[colors[p] for p in names])
    ax_time.bar_label(bars, fmt="%.2f ms", fontsize=8)
    ax_time.set_ylim(0, 1.15 * max(step_ms.values()))  # room above the tallest bar for its label, inside the frame
    ax_time.set_ylabel(f"ms per step on the {gpu_name}\n({time_words})")
    other = names[-1]
    ratio = f"× {step_ms[other] / step_ms['fp32']:.2f} fp32's time"
    ax_time.set_title(f"{other}: {ratio}" if work_ratio is None else
                      f"{other}: {ratio}\n(× {work_ratio:.2f} by its work alone)", fontsize=9)
    return fig
