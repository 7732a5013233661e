"""python -m labkit.planner: print a plan (labkit.planner.plan.main; `--help` lists the knobs)."""

from labkit.planner import plan

if __name__ == "__main__":
    raise SystemExit(plan.main())
