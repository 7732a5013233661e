"""The planner (chapter 09, `make plan`): will a model train on some GPUs, and which setting is fastest?

An application built on labkit's core (`labkit.meter`, `labkit.estimate`, `labkit.models`), one job per module:
- `plan`: every combination of micro-batch, checkpointing, precision, offload and data parallelism, each peak from a
  training step on fake tensors, each step time a roofline (`labkit.gpus`); the command `python -m labkit.planner`;
- `allocator`: a step's allocations replayed through the CUDA caching allocator's rules (the reserved peak);
- `overheads`: what a GPU holds outside that allocator (the CUDA context, NCCL's buffers), as cited ranges;
- `published`: published runs beside the plan's figures (chapter 09's validation table);
- `check`: a plan against the meter's real steps (errors, fit verdicts, rank correlation);
- `plot`: the figures of a plan and of its check.
Importing the package loads none of them.
"""
