"""The planner checked against the meter (chapter 09): each combination's predicted peak and step time beside its
measured ones, and what the comparison says.

The chapter runs the combinations itself (`labkit.planner.plan.combination_step`, `labkit.measure_step`,
`labkit.measure_throughputs`); `PlanCheck` holds what it measured beside the plan's rows and computes the errors, the
fit verdicts, the step-time ratios and the rank correlation of the two orders.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.trend import rank_correlation


def short_name(c) -> str:
    """Return a combination's short name, e.g. "mb 2 × 2, every, bf16" (", offload", ", Adam on host") (chapter 09)."""
    return (f"mb {c.micro_batch} × {c.accum_steps}, {c.checkpointing}, {c.precision}"
            + (", offload" if c.offload else "") + (", Adam on host" if c.optimizer == "host" else ""))


def memory_bound(row, device) -> bool:
    """Return whether a row's roofline is set by its bytes, not its FLOPs, on `device` (a labkit.gpus profile)."""
    return row.bytes_accessed / device.memory_bytes_per_s > row.flops / device.flops_per_s[row.combination.precision]


def random_order_rho(n: int) -> float:
    """Return the rank correlation a random order of n items exceeds 2.5% of the time: 1.96/√(n − 1) (chapter 09)."""
    return 1.96 / (n - 1) ** 0.5 if n > 1 else float("inf")


@dataclass
class PlanCheck:
    """The plan's rows beside the meter's peaks and the timer's medians, by short name (chapter 09)."""

    predicted: dict  # name -> labkit.planner.plan.Row
    measured_bytes: dict  # name -> the meter's peak
    timed: dict  # name -> labkit.throughput.Throughput (the rows that were timed)
    budget_bytes: int

    @property
    def names(self) -> list:
        """Return the measured rows' names, in the order measured."""
        return list(self.measured_bytes)

    @property
    def timed_names(self) -> list:
        """Return the timed rows' names, in the order measured."""
        return [n for n in self.measured_bytes if n in self.timed]

    @property
    def errors(self) -> dict:
        """Return each row's |predicted − measured| / measured peak."""
        return {n: abs(self.predicted[n].peak_bytes - m) / m for n, m in self.measured_bytes.items()}

    @property
    def worst(self) -> str:
        """Return the name of the row with the largest peak error."""
        errors = self.errors
        return max(errors, key=errors.get)

    @property
    def fits_agree(self) -> int:
        """Return how many rows the plan and the meter give the same fit verdict."""
        b = self.budget_bytes
        return sum((self.predicted[n].peak_bytes <= b) == (m <= b) for n, m in self.measured_bytes.items())

    @property
    def fitting(self) -> int:
        """Return how many rows the meter finds within the budget."""
        return sum(m <= self.budget_bytes for m in self.measured_bytes.values())

    @property
    def ratios(self) -> list:
        """Return each timed row's measured / predicted step time."""
        return [self.timed[n].step_s / self.predicted[n].step_s for n in self.timed_names]

    def _code(self, name: str) -> tuple:
        """Return what decides the code a row runs: its micro-batch, precision, offload, optimizer placement and
        measured peak (`sqrt` at two blocks is one segment: the `none` rows again)."""
        c = self.predicted[name].combination
        return c.micro_batch, c.precision, c.offload, c.optimizer, self.measured_bytes[name]

    @property
    def rank_names(self) -> list:
        """Return the timed rows the orders are compared on: each code once (a twin would count one row twice)."""
        seen, out = set(), []
        for n in self.timed_names:
            if self._code(n) not in seen:
                seen.add(self._code(n))
                out.append(n)
        return out

    @property
    def rho(self) -> float:
        """Return Spearman's rank correlation of the predicted order of step times with the measured order, over
        rank_names."""
        names = self.rank_names
        return rank_correlation([self.predicted[n].step_s for n in names], [self.timed[n].step_s for n in names])

    @property
    def faster(self) -> list:
        """Return the timed rows that ran faster than predicted."""
        return [n for n in self.timed_names if self.timed[n].step_s < self.predicted[n].step_s]

    @property
    def noise(self) -> float:
        """Return the largest relative spread of step times among timed rows running identical code (nan: none).

        Identical code: the same micro-batch, precision, offload and optimizer placement, and the same measured peak
        (`sqrt` at two blocks is one segment: the `none` rows again)."""
        same: dict = {}
        for n in self.timed_names:
            same.setdefault(self._code(n), []).append(self.timed[n].step_s)
        spreads = [(max(ts) - min(ts)) / min(ts) for ts in same.values() if len(ts) > 1]
        return max(spreads) if spreads else float("nan")

    def table_rows(self) -> list:
        """Return the per-row table for labkit.tables.print_rows: peaks in bytes, error, fit, step times in ms."""
        rows = [("combination", "predicted B", "measured B", "error", "fits", "roofline+host ms", "median ms")]
        for n in self.names:
            p, m = self.predicted[n], self.measured_bytes[n]
            rows.append((n, f"{p.peak_bytes:,}", f"{m:,}", f"{self.errors[n]:.3%}",
                         "yes" if m <= self.budget_bytes else "no", f"{p.step_s * 1e3:.2f}",
                         f"{self.timed[n].step_s * 1e3:.1f}" if n in self.timed else "-"))
        return rows

    def twins(self, differ: str) -> list:
        """Return (name, twin name) of measured rows whose combinations differ only in `differ` ("offload":
        offload on, off; "optimizer": Adam on the host, on the device)."""
        by_combination = {self.predicted[n].combination: n for n in self.names}
        pairs = []
        for c, n in by_combination.items():
            if differ == "offload" and c.offload:
                twin = by_combination.get(replace(c, offload=False))
            elif differ == "optimizer" and c.optimizer == "host":
                twin = by_combination.get(replace(c, optimizer="device"))
            else:
                continue
            if twin is not None:
                pairs.append((n, twin))
        return pairs

    def ratio_rows(self, device) -> list:
        """Return a table of measured / predicted step times by precision and host transfers, for print_rows."""
        rows = [("timed rows", "n", "measured/predicted", "faster than predicted", "of them memory-bound")]
        groups: dict = {}
        for n in self.timed_names:
            p = self.predicted[n]
            groups.setdefault((p.combination.precision, p.host_s > 0), []).append(n)
        for (precision, host), names in sorted(groups.items()):
            ratios = [self.timed[n].step_s / self.predicted[n].step_s for n in names]
            faster = [n for n in names if n in self.faster]
            rows.append((f"{precision}, " + ("roofline + host (estimate)" if host else "roofline (bound)"),
                         len(names), f"{min(ratios):.1f}-{max(ratios):.1f}x", len(faster),
                         sum(memory_bound(self.predicted[n], device) for n in faster)))
        return rows
