"""Renew the closing page's test figures: a `make run`'s results.json cut to the records chapter 10 reads.

tests/data/closing_results.json is what `make test` runs chapter 10 on (LABKIT_RESULTS, Makefile) and what
tests/test_closing.py checks the page against; after a `make run`, renew it from build/results.json:

    .venv/bin/python -m workbook.closingfixture build/results.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from labkit.tools.closing import SOURCES

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "closing_results.json"
NOTE = ("these figures are a real `make run`'s results.json, cut to the records this page reads "
        "(tests/data/closing_results.json, the tests' copy): run `make run` for your own")  # the page prints it


def fixture_from(results: dict, note: str = NOTE) -> dict:
    """Return results.json cut to what the closing page reads (its metadata, each chapter's status and SOURCES records)."""
    out = {k: results[k] for k in ("generated_utc", "hardware", "torch", "parameters") if k in results}
    out["note"] = note
    out["notebooks"] = {}
    for stem, keys in SOURCES.items():
        entry = results.get("notebooks", {}).get(stem)
        if entry is not None:
            m = entry.get("measurements", {})
            out["notebooks"][stem] = {"status": entry.get("status"), "measurements": {k: m[k] for k in keys if k in m}}
    return out


def main(argv=None) -> int:
    """Write the fixture from a results.json; return 0."""
    ap = argparse.ArgumentParser(prog="python -m workbook.closingfixture", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", default="build/results.json", help="a `make run`'s results.json")
    ap.add_argument("--out", default=str(FIXTURE), help="where to write it (default: the tests' fixture)")
    args = ap.parse_args(argv)
    fixture = fixture_from(json.loads(Path(args.results).read_text()))
    Path(args.out).write_text(json.dumps(fixture, indent=1))
    print(f"wrote {args.out}: {len(fixture['notebooks'])} chapters' records from {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
