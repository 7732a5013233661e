"""Widget panels: controls and a Run button around an ordinary experiment function."""

from __future__ import annotations

import traceback

import ipywidgets as W
import torch


def _widget_for(name: str, spec):
    if isinstance(spec, W.ValueWidget):
        return spec
    if isinstance(spec, bool):
        return W.Checkbox(value=spec, description=name)
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(v, str) for v in spec):
        return W.Dropdown(options=list(spec), value=spec[0], description=name)
    # a tuple of numbers is a slider's range; a list is always options (a list of four micro-batch sizes
    # read as (min, max, step, value) gave an inverted slider)
    if isinstance(spec, tuple) and len(spec) in (3, 4) and all(isinstance(v, (int, float)) for v in spec):
        lo, hi, step = spec[:3]
        value = spec[3] if len(spec) == 4 else lo
        if all(isinstance(v, int) for v in spec):
            return W.IntSlider(value=value, min=lo, max=hi, step=step, description=name)
        return W.FloatSlider(value=value, min=lo, max=hi, step=step, description=name)
    if isinstance(spec, (list, tuple)) and spec:
        return W.Dropdown(options=list(spec), value=spec[0], description=name)
    raise TypeError(f"control {name!r}: give a widget, a bool, a list of options or (min, max, step[, value]); "
                    f"got {spec!r}")


class ControlPanel(W.VBox):
    """Controls, a Run button and an Output area; Run calls `run_fn(**values)` inside the output."""

    def __init__(self, run_fn, title: str = "", **controls):
        if not callable(run_fn):
            raise TypeError("control_panel needs a callable run_fn")
        self.run_fn = run_fn
        self.controls = {name: _widget_for(name, spec) for name, spec in controls.items()}
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.status = W.HTML()
        self.output = W.Output()
        self.last_result = None
        self.last_error: BaseException | None = None
        self.button.on_click(lambda _: self.run())
        head = [W.HTML(f"<b>{title}</b>")] if title else []
        super().__init__(head + list(self.controls.values()) + [W.HBox([self.button, self.status]), self.output])

    def values(self) -> dict:
        """Return the controls' current values by name."""
        return {name: w.value for name, w in self.controls.items()}

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


def control_panel(run_fn, title: str = "", **controls) -> ControlPanel:
    """Build a panel of controls (sliders, dropdowns, checkboxes) and a Run button over `run_fn`."""
    return ControlPanel(run_fn, title=title, **controls)
