"""labkit's smaller applications, one job each: gpucheck (`make gpu-check`), writefiles (a chapter's rank scripts),
search (chapter 08's command: workers, trials, Katib), closing (chapter 10's figures from the chapters' records).

The planner is its own subpackage, labkit.planner; the search's library is labkit.search.
"""
