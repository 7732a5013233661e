"""Did a speed study's predictions hold? Each verdict and peak against its run (chapter 08's checks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.device import resolve_device
from labkit.meter import format_bytes
from labkit.search.config import StudyConfig
from labkit.search.trial import SettingStep, _batches, confirm_oom, predict_step, runs_here
from labkit.search.workers import worker_of


@dataclass(frozen=True)
class FitHere:
    """A setting's predicted peak beside its metered one, against the budget: `fit_here`."""

    predicted_bytes: int  # one steady step on fake tensors
    measured_bytes: int | None  # metered with no budget; None: not run here (16-bit on a CPU without 16-bit units)
    budget_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Return the metered peak where the setting ran here, else the predicted one."""
        return self.predicted_bytes if self.measured_bytes is None else self.measured_bytes

    @property
    def fits(self) -> bool:
        """Tell whether that peak is within the budget."""
        return self.peak_bytes <= self.budget_bytes

    @property
    def agrees(self) -> bool:
        """Tell whether the prediction gives the meter's verdict on fitting (True where nothing was metered)."""
        return (self.predicted_bytes <= self.budget_bytes) == self.fits

    def verdict(self) -> str:
        """Return a table cell: "yes, metered", or "no, metered 0.97 MiB over" ("predicted" where not run here)."""
        how = "predicted" if self.measured_bytes is None else "metered"
        over = self.peak_bytes - self.budget_bytes
        return f"yes, {how}" if self.fits else f"no, {how} {format_bytes(over)} over"


def fit_here(params: dict, config: StudyConfig) -> FitHere:
    """Predict a setting's peak; meter `metered_steps` steps of it with no budget where it runs here (chapter 08)."""
    predicted = predict_step(params, config)[0]
    if not runs_here(params, config):
        return FitHere(predicted, None, config.budget_bytes)
    device = resolve_device(config.device, "config.device")
    step, batches = SettingStep(params, config, device), _batches(config, device)
    peak = max(step.metered_step(next(batches), None) for _ in range(config.metered_steps))
    return FitHere(predicted, peak, config.budget_bytes)


@dataclass
class PredictionCheck:
    """A speed study's predictions against its runs: `check_predictions`."""

    ran_within: list  # per trial that ran under the budget: whether it stayed within it, as predicted
    confirmed_oom: dict  # setting (sorted items) -> whether one step under the budget hit OutOfMemory, as predicted
    peak_errors: dict  # trial number -> (predicted - measured) / measured peak
    predicted_only: list  # trials predicted to fit and not run here (16-bit without 16-bit units)
    growth_bytes: int  # live tensor bytes at a trial's start: the largest rise over a worker's trials (2nd on)
    details: list = field(default_factory=list)  # (trial number, predicted B, measured B, params) where they differ

    @property
    def agreement(self) -> float:
        """Return the share of checks (runs and confirmations) whose prediction held."""
        checks = self.ran_within + list(self.confirmed_oom.values())
        return sum(checks) / len(checks)

    @property
    def largest_error(self) -> float:
        """Return the peak error furthest from 0 (positive: predicted more than measured)."""
        return max(self.peak_errors.values(), key=abs, default=0.0)

    def rows(self) -> list[tuple]:
        """Return (what, how many held, of how many / figure) rows for print_rows."""
        n_exact = sum(e == 0 for e in self.peak_errors.values())
        return [("ran within the budget, as predicted", f"{sum(self.ran_within)} of {len(self.ran_within)} trials"),
                ("hit OutOfMemory in one step, as predicted",
                 f"{sum(self.confirmed_oom.values())} of {len(self.confirmed_oom)} settings"),
                ("peaks exact to the byte", f"{n_exact} of {len(self.peak_errors)}"),
                ("largest peak difference", f"{self.largest_error:+.2%} (positive: predicted more)"),
                ("trials predicted to fit, not run here", _numbers(self.predicted_only)),
                ("live tensor growth over a worker's trials", f"{self.growth_bytes:+,} B")]


def answer_rows(settings: dict[str, dict], fit: dict[str, FitHere], speeds: dict[str, tuple],
                speed_header: tuple) -> list[tuple]:
    """Return chapter 08's table: each setting's name, peak, whether it fits here (FitHere.verdict), its speed cells
    ("-" where `speeds` has none: a setting that does not fit) and its knobs."""
    rows = [("setting", "peak", "fits here", *speed_header, "knobs")]
    for name, params in settings.items():
        cells = speeds.get(name, ("-",) * len(speed_header))
        knobs = {k: v for k, v in params.items() if k != "lr"}
        rows.append((name, format_bytes(fit[name].peak_bytes), fit[name].verdict(), *cells, knobs))
    return rows


def _numbers(trials: list) -> str:
    """Return trial numbers as "#3, #7", or "none"."""
    return ", ".join(f"#{n}" for n in trials) or "none"


def check_predictions(trials, config: StudyConfig, untried: tuple[dict, ...] = ()) -> PredictionCheck:
    """Set a speed study's predictions beside its runs: trials that ran (status ok or oom) against their predicted
    verdict and peak; each distinct setting predicted not to fit run for one step under the budget (`confirm_oom`),
    those of `untried` (settings the study may not have drawn) among them; whether a worker's live tensors grew from
    trial to trial (repeated settings: study.repeated_settings)."""
    ran = [t for t in trials if t.user_attrs.get("status") in ("ok", "oom")]
    skipped = {tuple(sorted(t.params.items())): dict(t.params, lr=1e-3)
               for t in trials if t.user_attrs.get("status") == "predicted_oom"}
    for params in untried:
        knobs = {k: v for k, v in params.items() if k != "lr"}
        if tuple(sorted(knobs.items())) not in skipped and predict_step(params, config)[0] > config.budget_bytes:
            skipped[tuple(sorted(knobs.items()))] = dict(knobs, lr=1e-3)
    errors = {t.number: (t.user_attrs["predicted_peak_bytes"] - t.user_attrs["peak_bytes"]) / t.user_attrs["peak_bytes"]
              for t in ran}
    by_pid: dict = {}  # each worker's live tensor bytes at its trials' starts, in order
    for t in sorted(trials, key=lambda t: t.datetime_start or 0):
        if "live_tensor_bytes_at_start" in t.user_attrs and worker_of(t):
            by_pid.setdefault(worker_of(t)["pid"], []).append(t.user_attrs["live_tensor_bytes_at_start"])
    growth = max((v[-1] - v[1] for v in by_pid.values() if len(v) > 2), default=0)  # from each worker's 2nd trial on
    by_number = {t.number: t for t in trials}
    details = [(n, by_number[n].user_attrs["predicted_peak_bytes"], by_number[n].user_attrs["peak_bytes"],
                by_number[n].params) for n, e in errors.items() if e]
    return PredictionCheck([t.user_attrs["status"] == "ok" for t in ran],
                           {k: confirm_oom(p, config) for k, p in skipped.items()}, errors,
                           [t.number for t in trials if t.user_attrs.get("status") == "predicted"], growth, details)
