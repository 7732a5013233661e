"""Widget panels: controls and a Run button around an ordinary experiment function."""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import itertools
import math
import textwrap
import traceback
from dataclasses import dataclass

import ipywidgets as W
import torch

MAX_CHECKED_SETTINGS = 200_000  # a panel whose checked controls have more combinations is checked no further
_CLAMPS = {"min", "max", "int", "float", "round", "abs", "len"}  # builtins a leading assignment may call
_REFUSALS = {"ParameterError", "ValueError", "TypeError"}  # what a leading `if ...: raise` refuses with
_ACCEPTED = "labkit.widgets: every check passed"


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


def _is_check(stmt: ast.stmt) -> bool:
    """A `validate.*(...)` / `check_*(...)` call, or an `if` whose body only prints and then raises or returns."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        return owner == "validate" or name.startswith("check_")
    if isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.body[-1], (ast.Raise, ast.Return)):
        last = stmt.body[-1]
        if isinstance(last, ast.Raise):  # a refusal raises a parameter error, not any error
            exc = last.exc.func if isinstance(last.exc, ast.Call) else last.exc
            if (getattr(exc, "attr", None) or getattr(exc, "id", None)) not in _REFUSALS:
                return False
        return all(s is last or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                                 and getattr(s.value.func, "id", "") == "print") for s in stmt.body)
    return False


def _is_clamp(stmt: ast.stmt) -> bool:
    """`name = min(name, other)`-like: an assignment to one name that calls only a few pure builtins."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    calls = [n for n in ast.walk(stmt.value) if isinstance(n, ast.Call)]
    return all(isinstance(c.func, ast.Name) and c.func.id in _CLAMPS for c in calls)


def validation_of(fn):
    """Return (checks, names): `fn`'s leading checks as a function of its arguments, and the arguments they read.

    The function returns `_ACCEPTED` when every check passes; (None, set()) when fn has no leading checks.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None, set()
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, ast.FunctionDef) or getattr(fn, "__code__", None) is None or fn.__code__.co_freevars:
        return None, set()
    body = fdef.body[1:] if (fdef.body and isinstance(fdef.body[0], ast.Expr)
                             and isinstance(fdef.body[0].value, ast.Constant)) else fdef.body
    leading = list(itertools.takewhile(lambda s: _is_check(s) or _is_clamp(s), body))
    while leading and not _is_check(leading[-1]):
        leading.pop()  # clamps after the last check check nothing
    if not leading:
        return None, set()
    args = set(inspect.signature(fn).parameters)
    read = lambda s: {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}  # noqa: E731
    names = set()  # the arguments the checks read, directly or through the clamps before them
    for s in reversed(leading):
        if _is_check(s):
            names |= read(s)
        elif s.targets[0].id in names:
            names |= read(s)
    names &= args
    fdef.decorator_list = []
    fdef.body = leading + [ast.Return(ast.Constant(_ACCEPTED))]
    module = ast.fix_missing_locations(ast.Module(body=[fdef], type_ignores=[]))
    code = next(c for c in compile(module, fn.__code__.co_filename, "exec").co_consts if inspect.iscode(c))
    checks = type(fn)(code, fn.__globals__, fn.__name__, fn.__defaults__)
    checks.__kwdefaults__ = fn.__kwdefaults__
    return checks, names


def refusal(checks, values: dict) -> str | None:
    """Run `checks(**values)`; return why they refuse (the error, or what they printed before returning), or None."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            got = checks(**values)
    except Exception as e:  # a ParameterError, or any error the checks raise
        return f"{type(e).__name__}: {e}"
    return None if got == _ACCEPTED else (out.getvalue().strip() or f"returned {got!r} before running")


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
