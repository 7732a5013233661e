"""The repository's own tooling, run from its root and not installed: what make run, test, lab, student, grade run."""
