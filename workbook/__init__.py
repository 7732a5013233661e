"""The repository's own tooling (run from its root, not installed): runner, report, nbcheck, figcheck, classroom, hosted, lab."""
