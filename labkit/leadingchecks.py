"""Read a function's leading checks from its source: the valid values a widget panel offers (labkit.widgets).

An experiment function of a chapter starts with its parameter checks (`validate.check_*(...)`, or `if ...: raise
ParameterError(...)` / print-and-return), then does its work. `validation_of(fn)` compiles those leading statements
alone into a function of the same arguments, so a panel can try a setting (`refusal`) without running the work. This
is the one place labkit reads code as data: a panel that declares its choices (`widgets.choices`) does not need it.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import itertools
import textwrap

_CLAMPS = {"min", "max", "int", "float", "round", "abs", "len"}  # builtins a leading assignment may call
_REFUSALS = {"ParameterError", "ValueError", "TypeError"}  # what a leading `if ...: raise` refuses with
_ACCEPTED = "labkit.leadingchecks: every check passed"


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
