"""Every chapter refuses bad parameters in its validation cell, naming the parameter, before any work.

Only the cells up to the validation cell run (in this process: `validate_parameters` in
conftest.py); the defaults of every chapter must pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import labkit
from workbook.nbcheck import find_notebooks

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
STEMS = [p.stem for p in find_notebooks(NOTEBOOKS)]

BAD = [  # (chapter, parameters, words the error must contain)
    ("00_where_the_memory_goes", dict(BATCH=0), ["BATCH", "[1, 4096]"]),
    ("00_where_the_memory_goes", dict(DEVICE="tpu"), ["DEVICE", "'auto', 'cpu', 'cuda'"]),
    ("00_where_the_memory_goes", dict(BUDGET_MIB=-5), ["BUDGET_MIB", "positive"]),
    ("00_where_the_memory_goes", dict(N_EMBD=100, N_HEAD=3), ["N_EMBD", "N_HEAD", "divisible"]),
    ("00_where_the_memory_goes", dict(SEQ_LEN_SWEEP=[16, 32]), ["SEQ_LEN_SWEEP", "at least 3"]),
    ("00_where_the_memory_goes", dict(BATCH_SWEEP=8), ["BATCH_SWEEP", "list"]),
    ("00_where_the_memory_goes", dict(BATCH_SWEEP=[2, 8, 4]), ["BATCH_SWEEP", "increasing"]),
    ("00_where_the_memory_goes", dict(INPLACE_ROWS=0), ["INPLACE_ROWS", "[1, 65536]"]),
    ("00_where_the_memory_goes", dict(MEMORY_SNAPSHOT="trace.json"), ["MEMORY_SNAPSHOT", ".pickle"]),
    ("01_gradient_accumulation", dict(BATCH=8, MICRO_BATCH=8), ["MICRO_BATCH", "[1, 7]"]),
    ("01_gradient_accumulation", dict(ACCUM_STEPS_SWEEP=[1, 5]), ["ACCUM_STEPS_SWEEP", "k=5", "cannot realise"]),
    ("01_gradient_accumulation", dict(ACCUM_STEPS_SWEEP_FIXED_MICRO=[2, 4]), ["ACCUM_STEPS_SWEEP_FIXED_MICRO", "starting at 1"]),
    ("01_gradient_accumulation", dict(DEVICE="tpu"), ["DEVICE", "'auto', 'cpu', 'cuda'"]),
    ("02_activation_checkpointing", dict(SWEEP_N_LAYER=1), ["SWEEP_N_LAYER", "[2, 64]"]),
    ("02_activation_checkpointing", dict(SWEEP_BATCH=1, SEQ_LEN=16), ["SWEEP_BATCH × SEQ_LEN", "32 tokens"]),
    ("03_mixed_precision", dict(LOSS_SCALE=1000.0), ["LOSS_SCALE", "power of two"]),
    ("03_mixed_precision", dict(N_EMBD_SWEEP=[30]), ["N_EMBD_SWEEP", "N_HEAD", "divisible"]),
    ("03_mixed_precision", dict(N_EMBD_SWEEP=list(range(32, 320, 32))), ["N_EMBD_SWEEP", "1 to 8"]),
    ("03_mixed_precision", dict(BATCH=4, ACCUM_STEPS=8), ["ACCUM_STEPS", "<= BATCH"]),
    ("04_activation_offload", dict(HOST_TIER="ssd"), ["HOST_TIER", "'disk'"]),
    ("04_activation_offload", dict(MIN_OFFLOAD_BYTES=-1), ["MIN_OFFLOAD_BYTES", "[0, "]),
    ("04_activation_offload", dict(COPY_MIB=0), ["COPY_MIB", "[1, 4096]"]),
    ("05_layer_to_layer", dict(ACCUM_STEPS_SWEEP=[2, 4]), ["ACCUM_STEPS_SWEEP", "starting at 1"]),
    ("05_layer_to_layer", dict(N_LAYER_SWEEP=[8, 4]), ["N_LAYER_SWEEP", "increasing"]),
    ("05_layer_to_layer", dict(SWEEP_N_EMBD=30), ["SWEEP_N_EMBD", "divisible"]),
    ("06_model_and_tensor_parallel", dict(N_RANKS=5), ["N_RANKS", "[2, 4]"]),  # more ranks than blocks
    ("06_model_and_tensor_parallel", dict(N_RANKS=1), ["N_RANKS", "[2, 4]"]),
    ("06_model_and_tensor_parallel", dict(N_HEAD=4, N_RANKS=3, N_LAYER=6), ["N_HEAD", "N_RANKS", "divisible"]),
    ("06_model_and_tensor_parallel", dict(DEVICE="tpu"), ["DEVICE", "'auto', 'cpu', 'cuda'"]),
    ("06b_pipeline_parallel", dict(N_RANKS=5), ["N_RANKS", "[2, 4]"]),  # more stages than blocks
    ("06b_pipeline_parallel", dict(ACCUM_STEPS_SWEEP=[1, 3]), ["BATCH", "ACCUM_STEPS_SWEEP", "divisible"]),
    ("06b_pipeline_parallel", dict(ACCUM_STEPS_SWEEP=[4, 2]), ["ACCUM_STEPS_SWEEP", "increasing"]),
    ("06b_pipeline_parallel", dict(ACCUM_STEPS_SWEEP=[1, 32]), ["ACCUM_STEPS_SWEEP[1]", "[1, 16]"]),
    ("06b_pipeline_parallel", dict(ACCUM_STEPS_SWEEP=[1, 2]), ["ACCUM_STEPS_SWEEP", "two", "N_RANKS"]),
    ("06b_pipeline_parallel", dict(BATCH=12, ACCUM_STEPS_SWEEP=[2, 3], MEMORY_RANKS=4),
     ["MEMORY_RANKS", "1F1B"]),
    ("06b_pipeline_parallel", dict(DEVICE="tpu"), ["DEVICE", "'auto', 'cpu', 'cuda'"]),
    ("07_sharded_data_parallel", dict(N_RANKS=1), ["N_RANKS", "[2, 16]"]),
    ("07_sharded_data_parallel", dict(BATCH=10, N_RANKS=4), ["BATCH", "N_RANKS", "divisible"]),
    ("07_sharded_data_parallel", dict(MEMORY_RANKS=3), ["BATCH", "MEMORY_RANKS", "divisible"]),
    ("07_sharded_data_parallel", dict(ESTIMATE_RANKS=[8, 1]), ["ESTIMATE_RANKS", "[2, 4096]"]),
    ("07_sharded_data_parallel", dict(ESTIMATE_RANKS=64), ["ESTIMATE_RANKS", "list"]),
    ("07_sharded_data_parallel", dict(ESTIMATE_RANKS=[512, 8]), ["ESTIMATE_RANKS", "increasing"]),
    ("07_sharded_data_parallel", dict(N_HEAD=3), ["N_HEAD", "divisible"]),
    ("07_sharded_data_parallel", dict(DEVICE="tpu"), ["DEVICE", "'auto', 'cpu', 'cuda'"]),
    ("08_memory_aware_search", dict(N_TRIALS=3), ["N_TRIALS", "[6, 1000]"]),
    ("08_memory_aware_search", dict(FULL_STUDY="yes"), ["FULL_STUDY", "(True, False)"]),
    ("08_memory_aware_search", dict(N_WORKERS=1), ["KILL_WORKER", "N_WORKERS >= 2"]),
    ("08_memory_aware_search", dict(PRUNER="patient"), ["PRUNER", "'median'"]),
    ("08_memory_aware_search", dict(SPEEDUP_TRIALS=3), ["SPEEDUP_TRIALS", "divisible"]),
    ("08_memory_aware_search", dict(ENGINE_TRIALS=7, SAMPLER_TRIALS=6), ["ENGINE_TRIALS", "[3, 6]"]),
    ("08_memory_aware_search", dict(SEARCH="grid"), ["SEARCH", "'all', 'tpe'"]),
    ("08_memory_aware_search", dict(STORAGE="sqlite://"), ["STORAGE", "in-memory"]),
    ("08_memory_aware_search", dict(RESUME_STUDY="no-such-study"), ["RESUME_STUDY", "not a study"]),
    ("08_memory_aware_search", dict(FINALISTS=0), ["FINALISTS", "[1, 30]"]),
    ("08_memory_aware_search", dict(STORAGE="studies.db"), ["STORAGE", "sqlite:///"]),
    ("08_memory_aware_search", dict(STUDY="my study"), ["STUDY", "letters"]),
    ("08_memory_aware_search", dict(DEVICE="tpu"), ["DEVICE", "'auto', 'cpu', 'cuda'"]),
    ("09_will_it_fit", dict(MODEL="gpt-17"), ["MODEL", "'gpt2'", "'llama-7b'"]),
    ("09_will_it_fit", dict(GPU="v100"), ["GPU", "'t4'", "'h100'"]),
    ("09_will_it_fit", dict(GPUS=3), ["PLAN_BATCH", "divisible by GPUS (3)"]),
    ("09_will_it_fit", dict(PLAN_SEQ_LEN=2048), ["PLAN_SEQ_LEN", "[1, 1024]"]),
    ("09_will_it_fit", dict(PLAN_DEPTH="half"), ["PLAN_DEPTH", "'fast', 'full'"]),
    ("09_will_it_fit", dict(RESERVE_FRACTION=1.0), ["RESERVE_FRACTION", "[0.0, 1.0)"]),
    ("09_will_it_fit", dict(DEVICE="cuda"), ["DEVICE", "('cpu',)"]),
    ("09_will_it_fit", dict(BATCH=0), ["BATCH", "[1, 16]"]),
    ("10_what_to_use_when", dict(RESULTS="no/such/results.json"), ["RESULTS", "no file"]),
    ("10_what_to_use_when", dict(GPUS_PER_NODE=1), ["GPUS_PER_NODE", "[2, 64]"]),
]


@pytest.mark.parametrize("stem", STEMS)
def test_defaults_are_valid(validate_parameters, stem):
    assert validate_parameters(stem) is None


@pytest.mark.parametrize("stem, parameters, words", BAD, ids=[f"{s[:2]}-{'-'.join(p)}" for s, p, _ in BAD])
def test_bad_parameters_are_refused_naming_them(validate_parameters, stem, parameters, words):
    error = validate_parameters(stem, **parameters)
    assert isinstance(error, labkit.ParameterError), error
    for word in words:
        assert word in str(error), (word, str(error))


def test_every_chapter_has_bad_parameter_cases():
    assert sorted({stem for stem, _, _ in BAD}) == STEMS


@pytest.mark.parametrize("stem", STEMS)
def test_papermill_reads_every_parameter_with_its_comment(stem, caplog):
    """`papermill --help-notebook` (and Jupyter's parameter tools) list each parameter with its comment as help."""
    import ast

    import nbformat
    import papermill

    nb = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assigned = [t.id for node in ast.parse(cell.source).body if isinstance(node, ast.Assign) for t in node.targets]
    with caplog.at_level("WARNING", logger="papermill"):
        read = papermill.inspect_notebook(str(NOTEBOOKS / f"{stem}.ipynb"))
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # "Unable to parse line ..."
    assert list(read) == assigned and all(p["help"] for p in read.values()), read
