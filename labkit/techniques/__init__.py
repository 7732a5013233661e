"""The techniques as the chapters teach them: tested references a chapter checks its visible code against and later
chapters and applications reuse. Each module's docstring names its chapter:

| module | chapter |
|---|---|
| `accumulation` | 01 |
| `checkpointing` | 02 |
| `precision` | 03 |
| `offload` | 04 |
| `hosttier` | 04, 05 |
| `l2l` | 05 |
| `pipeline` | 06, 06b |
| `zero` | 07 |

Importing the package loads none of them. Their names before they moved here (labkit.<module>) still import, with a
DeprecationWarning.
"""
