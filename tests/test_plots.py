"""labkit.plots: the grouped bar plot puts one bar per series in each group, side by side."""

from __future__ import annotations

from labkit import plots


def test_grouped_bars_place_each_series_beside_the_others_and_skip_missing_values():
    series = {"DDP": {"parameters": 4.0, "activations": 9.0}, "DDP formula": {"parameters": 4.0},
              "ZeRO-3": {"parameters": 1.0, "activations": 9.0}}
    fig, ax = plots.new_figure()
    bars = plots.plot_grouped_bars(series, ax=ax, hatches={"DDP formula": "//"}, names={"activations": "acts"})
    assert [len(b) for b in bars.values()] == [2, 1, 2]  # no formula bar for activations
    heights = {label: [r.get_height() for r in b] for label, b in bars.items()}
    assert heights == {"DDP": [4.0, 9.0], "DDP formula": [4.0], "ZeRO-3": [1.0, 9.0]}
    lefts = [b[0].get_x() for b in bars.values()]  # first group: the three bars side by side, in series order
    assert lefts == sorted(lefts) and len(set(lefts)) == 3
    assert all(abs(b[0].get_x() + b[0].get_width() / 2) < 0.5 for b in bars.values())  # all within group 0
    assert bars["DDP formula"][0].get_hatch() == "//" and bars["DDP"][0].get_hatch() is None
    assert [t.get_text() for t in ax.get_xticklabels()] == ["parameters", "acts"]
    assert plots.png_bytes(fig).startswith(b"\x89PNG")


def test_series_colors_share_none_with_categories_phases_or_gantt():
    """A method's colour never reads as a memory category, a phase or a Gantt kind."""
    from labkit import plots

    taken = {c.lower() for c in (*plots.CATEGORY_COLORS.values(), *plots.PHASE_COLORS.values(),
                                 *plots.ACTION_COLORS.values(), plots.WAIT_COLOR, plots.COMM_COLOR)}
    assert len(set(plots.SERIES_COLORS)) == len(plots.SERIES_COLORS)
    assert not {c.lower() for c in plots.SERIES_COLORS} & taken
    assert plots.COMM_COLOR.lower() not in {c.lower() for c in plots.CATEGORY_COLORS.values()}
