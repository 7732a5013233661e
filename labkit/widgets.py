"""Widget panels: controls and a Run button around an ordinary experiment function."""

from __future__ import annotations

import itertools
import math
import traceback
from dataclasses import dataclass

import ipywidgets as W
import torch

from labkit.leadingchecks import refusal, validation_of

MAX_CHECKED_SETTINGS = 200_000  # a panel whose checked controls have more combinations is checked no further


@dataclass(frozen=True)
class Choices:
    """A control's valid values in order, and the one it starts at: a slider over numbers, a dropdown otherwise."""

    values: tuple
    value: object = None


def choices(values, value=None) -> Choices:
    """Offer exactly these values (in this order), starting at `value` (default: the first)."""
    values = tuple(values)
    if not values:
        raise ValueError("choices needs at least one value")
    if value is not None and value not in values:
        raise ValueError(f"choices: the starting value {value!r} is not among {list(values)}")
    return Choices(values, values[0] if value is None else value)


def _numbers(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _widget_for(name: str, spec):
    if isinstance(spec, W.ValueWidget):
        return spec
    if isinstance(spec, bool):
        return W.Checkbox(value=spec, description=name)
    if isinstance(spec, list) and spec:
        spec = choices(spec)
    if isinstance(spec, Choices):  # numbers on a slider (keys and drag move it), names in a dropdown
        kind = W.SelectionSlider if _numbers(spec.values) and len(spec.values) > 1 else W.Dropdown
        return kind(options=list(spec.values), value=spec.value, description=name)
    # a tuple of numbers is a slider's range; a list is always options
    if isinstance(spec, tuple) and len(spec) in (3, 4) and _numbers(spec):
        lo, hi, step = spec[:3]
        value = spec[3] if len(spec) == 4 else lo
        kind = W.IntSlider if all(isinstance(v, int) for v in spec) else W.FloatSlider
        return kind(value=value, min=lo, max=hi, step=step, description=name)
    if isinstance(spec, tuple) and spec:
        return W.Dropdown(options=list(spec), value=spec[0], description=name)
    raise TypeError(f"control {name!r}: give a widget, a bool, a list of valid values, choices(values, value) or "
                    f"(min, max, step[, value]); got {spec!r}")


def positions(widget) -> list:
    """Return every value a control can be moved to, in order (a widget of another kind: its current value)."""
    if isinstance(widget, (W.Checkbox, W.ToggleButton)):
        return [False, True]
    if isinstance(widget, W.IntSlider):
        return list(range(widget.min, widget.max + 1, widget.step))
    if isinstance(widget, W.FloatSlider):
        n = int(round((widget.max - widget.min) / widget.step))
        return [min(widget.min + i * widget.step, widget.max) for i in range(n + 1)]
    if hasattr(widget, "_options_values"):  # Dropdown, SelectionSlider, RadioButtons, ToggleButtons
        return list(widget._options_values)
    return [widget.value]


class ControlPanel(W.VBox):
    """Controls, a Run button and an Output area; Run calls `run_fn(**values)` inside the output.

    With `check=True` a setting that `run_fn`'s leading checks refuse is a ValueError naming it.
    """

    def __init__(self, run_fn, title: str = "", check: bool = True, **controls):
        if not callable(run_fn):
            raise TypeError("control_panel needs a callable run_fn")
        self.run_fn = run_fn
        self.controls = {name: _widget_for(name, spec) for name, spec in controls.items()}
        if check:
            refused = self.refusals(limit=1)
            if refused:
                setting, why = refused[0]
                raise ValueError(f"the panel offers {setting}, which {getattr(run_fn, '__name__', 'run_fn')} refuses "
                                 f"({why}); offer only the values it accepts, e.g. as a list of them")
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.status = W.HTML()
        self.output = W.Output()
        self.last_result = None
        self.last_error: BaseException | None = None
        self.button.on_click(lambda _: self.run())
        head = [W.HTML(f"<b>{title}</b>")] if title else []
        super().__init__(head + list(self.controls.values()) + [W.HBox([self.button, self.status]), self.output])

    def __repr__(self) -> str:
        """Return the panel as a page without live widgets shows it (a static copy, GitHub's viewer, a terminal)."""
        return f"[a panel that runs in Jupyter, controls: {', '.join(self.controls)}]"  # (ipywidgets cuts it at 110)

    def values(self) -> dict:
        """Return the controls' current values by name."""
        return {name: w.value for name, w in self.controls.items()}

    def refusals(self, limit: int | None = None) -> list[tuple[dict, str]]:
        """Return (setting, why) for each combination of the checked controls' positions `run_fn`'s checks refuse."""
        checks, names = validation_of(self.run_fn)
        names = [n for n in self.controls if n in names]
        if checks is None or not names:
            return []
        pos = [positions(self.controls[n]) for n in names]
        count = math.prod(len(p) for p in pos)
        if count > MAX_CHECKED_SETTINGS:
            raise ValueError(f"the panel's checked controls {sorted(names)} have {count:,} combinations, more than "
                             f"{MAX_CHECKED_SETTINGS:,}: offer fewer positions")
        found = []
        for combo in itertools.product(*pos):
            why = refusal(checks, {**self.values(), **dict(zip(names, combo))})
            if why is not None:
                found.append((dict(zip(names, combo)), why))
                if limit and len(found) >= limit:
                    break
        return found

    def run(self):
        """Call the experiment with the current values; show its output, or its error, in the panel."""
        self.output.clear_output(wait=True)
        self.button.disabled = True
        self.status.value = "running…"
        self.last_result = None  # a failed run returns None, not the previous run's result
        self.last_error = None
        try:
            with self.output:
                try:
                    self.last_result = self.run_fn(**self.values())
                    self.status.value = "done"
                except torch.OutOfMemoryError as e:  # labkit's OutOfMemory, or the CUDA allocator's
                    self.last_error = e.with_traceback(None)  # frames would hold the step's tensors
                    self.status.value = "<span style='color:#c44e52'>does not fit</span>"
                    print(f"Does not fit: {e}")
                except Exception as e:  # shown in the panel, never lost in a callback
                    self.status.value = f"<span style='color:#c44e52'>error: {type(e).__name__}</span>"
                    traceback.print_exc()
                    self.last_error = e.with_traceback(None)  # printed above; frames would hold tensors
        finally:
            self.button.disabled = False
        return self.last_result


def control_panel(run_fn, title: str = "", check: bool = True, **controls) -> ControlPanel:
    """Build a panel of controls (sliders, dropdowns, checkboxes) and a Run button over `run_fn`; see ControlPanel."""
    return ControlPanel(run_fn, title=title, check=check, **controls)
