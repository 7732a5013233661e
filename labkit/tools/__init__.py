"""Programs a learner runs: gpucheck (a GPU's check), writefiles (rank scripts), search (08's workers), closing (10)."""
