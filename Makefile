# Fit the Model: one command each. Every target creates .venv first when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup run readtime test unit lab student grade gpu-check plan bench dashboard clean

# labkit declares a torch range; constraints.txt pins the exact versions the project is tested with
# (here: the CPU wheel of torch on disk). Only `make setup` and CI use it.
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[test,classroom]'
	$(PIP_INSTALL) --no-build-isolation -e '.[deepspeed]' \
		|| echo "DeepSpeed did not install: the test of the DeepSpeed configs will be skipped"
	$(PIP_INSTALL) -e '.[plan]' \
		|| echo "transformers did not install: the planner's Hugging Face config test will be skipped"
	$(PIP_INSTALL) -e '.[engines]' \
		|| echo "The engines extra did not install: Hyperopt, Ray Tune, Katib and PostgreSQL tests will be skipped"
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install labkit with its dependencies

run: $(STAMP)  ## execute every notebook (fast defaults) into build/, write build/results.json and build/report.html; 10, last, reads the others' figures
	$(PY) -m workbook.runner --notebooks notebooks --out build

readtime: $(STAMP)  ## each executed chapter's reading time (prose, output, code; appendix left out) against a 60-minute sitting; run after make run
	$(PY) -m workbook.readtime build/notebooks

# Tests run in TEST_WORKERS processes (pytest-xdist; a notebook's cells stay together in one), each on one
# thread: two processes of two OpenMP threads on two cores spin against each other and run many times slower.
# One worker per core. A third worker on 2 cores, meant to run tests while others wait on the processes they
# started (engines, ranks, a browser, timeouts), cost more CPU than it filled: 1,203 busy CPU-s and 605 s of pytest,
# against 994-1,011 CPU-s and 537-549 s with 2; in a slower hour 1,329 CPU-s (668 s) against 1,198-1,269 (639-678 s)
# (2026-12-06, a 2-core Zen 4 under the AVX2 variables).
TEST_WORKERS ?= $(shell nproc)
# LABKIT_RESULTS: the closing page (10) reads the committed figures of a real `make run` (it says so), not
# whatever build/results.json holds, so that nbval runs it the same on every machine without running a chapter for it
# LABKIT_PLAN_WORKERS=1: the planner runs its fake steps in the test's own process (the test processes fill the cores)
# OMP_WAIT_POLICY=PASSIVE: a process a test gives two threads (chapter 08's 1 worker x 2 threads) lets its idle thread
# sleep instead of spinning on a core other processes need (a 2-thread training loop beside one busy process: 1.97 s
# of wall and 2.6 CPU-s spinning, 0.97 s and 0.97 CPU-s passive; AMD EPYC, 2 cores, AVX2)
TEST_ENV := LABKIT_BATCH=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE LABKIT_PLAN_WORKERS=1 LABKIT_RESULTS=$(CURDIR)/tests/data/closing_results.json

test: $(STAMP)  ## unit and notebook tests, then nbval over every notebook; the 15 slowest tests are listed at the end
	$(PY) -m workbook.nbcheck notebooks build/nbval
	$(TEST_ENV) $(PY) -m pytest tests build/nbval --nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=15

unit: $(STAMP)  ## labkit's unit tests only: no notebook is run (tests marked `notebook` are left out)
	$(TEST_ENV) $(PY) -m pytest tests -m "not notebook" -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope --durations=10

LAB_ARGS ?=
STUDENT ?=
lab: $(STAMP)  ## JupyterLab on notebooks/, the first chapter open, no news prompt, a fresh layout (token on); e.g. LAB_ARGS="--port 9999"; STUDENT=1: on the student copies (make student), nbgrader's teacher tools off
	$(PY) -m workbook.lab $(if $(STUDENT),--student) $(LAB_ARGS)

student: $(STAMP)  ## write a student copy of every chapter to build/student/ (nbgrader: solutions replaced by stubs)
	$(PY) -m workbook.classroom student

SUBMISSIONS ?=
grade: $(STAMP)  ## autograde SUBMISSIONS=dir (<student>/<chapter>.ipynb); scores in build/grades/scores.csv and .html
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=folder (one folder per student, chapters inside)"; exit 2; }
	LABKIT_BATCH=1 $(PY) -m workbook.classroom grade --submissions "$(SUBMISSIONS)"

GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)  ## every CUDA path at GPT-2 small: a table, and build/gpu-check.json (needs CUDA; exit 2 without)
	@$(PY) -m workbook.gpucheck --out build $(GPU_CHECK_ARGS)

MODEL ?= gpt2
GPU ?= a100-80gb
GPUS ?= 1
SEQ_LEN ?= 1024
BATCH ?= 8
PLAN_ARGS ?=
plan: $(STAMP)  ## every technique combination for MODEL on GPUS x GPU (fake-tensor peaks, roofline times), the fastest that fits; e.g. MODEL=llama-7b GPU=a100-80gb GPUS=8 PLAN_ARGS="--json"
	@$(PY) -m labkit.planner --model $(MODEL) --gpu $(GPU) --gpus $(GPUS) --seq-len $(SEQ_LEN) --batch $(BATCH) $(PLAN_ARGS)

BENCH_ARGS ?=
bench: $(STAMP)  ## time this machine: its CPU (bf16/fp32 matmul), each chapter's defaults, the 7B plan, make test's pytest time; e.g. BENCH_ARGS="--only cpu plan" or "--repeats 3" (medians); on AVX-512/AMX set ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 to time as a 2-core AVX2 machine
	$(PY) -m workbook.bench $(BENCH_ARGS)

DASHBOARD_STORAGE ?= sqlite:///$(CURDIR)/build/search/studies.db
DASHBOARD_PORT ?= 8080
dashboard: $(STAMP)  ## Optuna's dashboard on chapter 08's studies (DASHBOARD_STORAGE=url), at http://127.0.0.1:8080
	$(VENV)/bin/optuna-dashboard --host 127.0.0.1 --port $(DASHBOARD_PORT) "$(DASHBOARD_STORAGE)"

clean:
	rm -rf build
