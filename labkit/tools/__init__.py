"""Command-line programs of the workbook (what `make` runs): runner (make run), report, nbcheck (make test)."""
