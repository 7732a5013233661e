"""One search space over the chapters' knobs (notebook 08), with conditional parameters, for Optuna, Hyperopt, Ray
Tune and Kubeflow Katib."""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.validate import ParameterError, check_int

PARAM_KINDS = ("float", "int", "categorical")


@dataclass(frozen=True)
class Param:
    """One searched hyperparameter."""

    name: str  # the key in the trial's params
    kind: str  # "float", "int" or "categorical"
    low: float | None = None  # float/int: smallest value
    high: float | None = None  # float/int: largest value (included)
    log: bool = False  # float/int: drawn uniformly in log space
    choices: tuple = ()  # categorical: the values
    when: tuple | None = None  # (parent name, values of the parent for which this parameter exists)
    doc: str = ""  # what it is, for tables and Katib descriptions

    def __post_init__(self):
        if self.kind not in PARAM_KINDS:
            raise ValueError(f"kind must be one of {PARAM_KINDS}, got {self.kind!r}")
        if self.kind == "categorical":
            if not self.choices:
                raise ValueError(f"categorical parameter {self.name!r} needs choices")
        elif self.low is None or self.high is None or not self.low <= self.high:
            raise ValueError(f"parameter {self.name!r} needs low <= high, got {self.low!r}, {self.high!r}")
        if self.log and (self.kind == "categorical" or self.low <= 0):
            raise ValueError(f"log-scaled parameter {self.name!r} needs a numeric range above 0")


def is_active(param: Param, params: dict) -> bool:
    """Return True when `param` exists for the parents' values in `params`."""
    if param.when is None:
        return True
    parent, values = param.when
    return parent in params and params[parent] in values


def active(params: dict, space: list[Param]) -> dict:
    """Return the parameters of `params` that exist for its parents' values (drop the inactive ones)."""
    out = {}
    for p in space:
        if p.name in params and is_active(p, out):
            out[p.name] = params[p.name]
    return out


def check_params(params: dict, space: list[Param]) -> dict:
    """Return `params` if it holds exactly the active parameters of `space`, each within its range; raise ParameterError otherwise."""
    names = {p.name for p in space}
    unknown = set(params) - names
    if unknown:
        raise ParameterError(f"unknown parameters {sorted(unknown)}; the space has {sorted(names)}")
    seen: dict = {}
    for p in space:
        if not is_active(p, seen):
            if p.name in params:
                raise ParameterError(f"{p.name} is not searched when {p.when[0]} = {seen.get(p.when[0])!r}")
            continue
        if p.name not in params:
            raise ParameterError(f"{p.name} is missing")
        v = params[p.name]
        if p.kind == "categorical":
            if v not in p.choices:
                raise ParameterError(f"{p.name} must be one of {p.choices}, got {v!r}")
        elif not p.low <= v <= p.high:
            raise ParameterError(f"{p.name} must lie in [{p.low}, {p.high}], got {v!r}")
        seen[p.name] = v
    return params


def enumerate_settings(space: list[Param]) -> list[dict]:
    """Return every setting of a space of categorical and int parameters, each with its active parameters only."""
    settings = [{}]
    for p in space:
        if p.kind == "float":
            raise ValueError(f"{p.name!r} is a float: a space with one has no finite list of settings")
        values = p.choices if p.kind == "categorical" else range(int(p.low), int(p.high) + 1)
        settings = [grown for s in settings
                    for grown in ([{**s, p.name: v} for v in values] if is_active(p, s) else [s])]
    return settings


TECHNIQUES = ("none", "checkpoint", "offload", "l2l")  # activations kept, recomputed (02), on the host (04), L2L (05)
MEMORY_KNOBS = ("technique", "segments", "precision", "micro_batch")  # what changes a step's bytes and speed


def workbook_space(n_layer: int, batch: int, precisions: tuple = ("fp32", "bf16"),
                   lr_range: tuple = (1e-4, 3e-2), min_micro_batch: int = 2) -> list[Param]:
    """Return the search space over the chapters' knobs for a model of `n_layer` blocks and `batch` samples a step."""
    check_int("n_layer", n_layer, 1)
    check_int("batch", batch, 1)
    micro = tuple(d for d in range(batch, 0, -1) if batch % d == 0 and d >= min(min_micro_batch, batch))
    return [
        Param("technique", "categorical", choices=TECHNIQUES,
              doc="activations: kept, checkpointed (02), offloaded to the host (04), or layer to layer (05)"),
        Param("segments", "int", 1, n_layer, when=("technique", ("checkpoint",)),
              doc="checkpoint segments (02): 1 keeps the fewest boundaries, n_layer checkpoints every block"),
        Param("precision", "categorical", choices=tuple(precisions), when=("technique", TECHNIQUES[:3]),
              doc="autocast precision of the step (03); L2L trains in fp32"),
        Param("micro_batch", "categorical", choices=micro, when=("technique", TECHNIQUES[:3]),
              doc="samples per micro-batch (01): batch / micro_batch accumulation steps; L2L takes the whole batch"),
        Param("lr", "float", lr_range[0], lr_range[1], log=True, doc="Adam's learning rate"),
    ]


def suggest(trial, space: list[Param]) -> dict:
    """Draw the active parameters of `space` from an Optuna trial, parents first."""
    params: dict = {}
    for p in space:
        if not is_active(p, params):
            continue
        if p.kind == "categorical":
            params[p.name] = trial.suggest_categorical(p.name, list(p.choices))
        elif p.kind == "int":
            params[p.name] = trial.suggest_int(p.name, int(p.low), int(p.high), log=p.log)
        else:
            params[p.name] = trial.suggest_float(p.name, p.low, p.high, log=p.log)
    return params


def _hp(p: Param, label: str):
    from hyperopt import hp

    if p.kind == "categorical":
        return hp.choice(label, list(p.choices))
    if p.kind == "int":
        return hp.uniformint(label, int(p.low), int(p.high))  # (no log-scaled ints in this space)
    if p.log:
        return hp.loguniform(label, math.log(p.low), math.log(p.high))
    return hp.uniform(label, p.low, p.high)


def to_hyperopt(space: list[Param]):
    """Return a Hyperopt space: one hp.choice branch per value of each parent, holding its children."""
    from hyperopt import hp

    children: dict[str, list[Param]] = {}
    for p in space:
        if p.when is not None:
            children.setdefault(p.when[0], []).append(p)
    out = {}
    for p in space:
        if p.when is not None:
            continue
        if p.name in children:
            if p.kind != "categorical":
                raise ValueError(f"conditions on {p.name!r} need it to be categorical")
            branches = []
            for value in p.choices:
                branch = {p.name: value}
                for c in children[p.name]:
                    if value in c.when[1]:
                        if c.name in children:
                            raise ValueError("to_hyperopt supports one level of conditions")
                        branch[c.name] = _hp(c, f"{c.name}|{p.name}={value}")  # labels must be unique
                branches.append(branch)
            out[p.name] = hp.choice(p.name, branches)
        else:
            out[p.name] = _hp(p, p.name)
    return out


def from_hyperopt(sample: dict, space: list[Param]) -> dict:
    """Flatten a Hyperopt sample of `to_hyperopt`'s space into a params dict (ints as int, numbers as Python's)."""
    flat = {}
    for k, v in sample.items():
        flat.update(v if isinstance(v, dict) else {k: v})
    kinds = {p.name: p.kind for p in space}
    out = {}
    for k, v in flat.items():
        if kinds.get(k) == "int":
            v = int(round(float(v)))
        elif kinds.get(k) == "float":
            v = float(v)
        elif hasattr(v, "item"):  # a numpy scalar among the choices
            v = v.item()
        out[k] = v
    return out


def katib_parameters(space: list[Param]) -> list[dict]:
    """Return Katib's `spec.parameters`: parameterType double/int/categorical, feasibleSpace values as strings."""
    out = []
    for p in space:
        if p.kind == "categorical":
            kind, feasible = "categorical", {"list": [str(c) for c in p.choices]}
        else:
            kind = "int" if p.kind == "int" else "double"
            fmt = (lambda v: str(int(v))) if p.kind == "int" else repr
            feasible = {"min": fmt(p.low), "max": fmt(p.high)}
            if p.log:
                feasible["distribution"] = "logUniform"
        out.append({"name": p.name, "parameterType": kind, "feasibleSpace": feasible})
    return out
