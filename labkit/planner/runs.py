"""The published runs chapter 09 checks the planner against (data/published_runs.json), and what their allocators kept.

labkit.planner.published sets each run's figures beside the plan's; this module only reads them, so that the plan's
table can say what published FSDP2 runs kept beyond their tensors without importing the checks.
"""

from __future__ import annotations

import json
from pathlib import Path

from labkit import gpus

RUNS_PATH = Path(__file__).parents[1] / "data" / "published_runs.json"
GiB = 2**30


def published_runs() -> list[dict]:
    """Return the published runs (data/published_runs.json's rows)."""
    return json.loads(RUNS_PATH.read_text())["rows"]


def fsdp2_gaps() -> dict:
    """Return {GPU: [each run's reserved less active peak, a share of the GPU's memory]} of the published FSDP2 runs
    that give both peaks (chapter 09's Appendix C): what the caching allocator kept beyond FSDP2's tensors."""
    gaps = {}
    for r in published_runs():
        if "peak_active_gib" in r.get("memory", {}) and r["plan"]["parallel"].startswith("fsdp2"):
            gpu = r["plan"]["gpu"]
            gaps.setdefault(gpu, []).append((r["memory"]["peak_reserved_gib"] - r["memory"]["peak_active_gib"]) * GiB
                                            / gpus.GPUS[gpu].memory_bytes)
    return gaps
