"""labkit.search.study: stored settings, the objectives, constraints, retries and the count of lost trials."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import optuna
import pytest
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from labkit import search
from labkit.children import machine_id
from labkit.search import storage as stores
from labkit.search import study as studies
from labkit.search import workers

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, batch=8, seq_len=16, train_steps=4, eval_every=2,
             eval_batch=8, timed_steps=2)
FITS = {"technique": "l2l", "lr": 1e-3}
DOES_NOT_FIT = {"technique": "none", "precision": "fp32", "micro_batch": 8, "lr": 1e-3}


@pytest.fixture(scope="module")
def config():
    plain = search.predict_peak_bytes(DOES_NOT_FIT, search.StudyConfig(budget_bytes=1, **SHAPE))
    return search.StudyConfig(budget_bytes=int(plain * 0.9), **SHAPE)


@pytest.fixture
def storage(tmp_path):
    return stores.make_storage(stores.sqlite_url(tmp_path / "s.db"), heartbeat_s=1, grace_s=2)


def test_a_study_stores_what_a_worker_needs(config, storage):
    study = studies.create_study("s", storage, config, "loss", sampler="random", pruner="none", seed=3)
    again = studies.load_study("s", storage, worker=1)
    assert studies.settings_of(again) == (config, "loss")
    assert isinstance(again.sampler, optuna.samplers.RandomSampler)
    assert isinstance(again.pruner, optuna.pruners.NopPruner)
    assert studies.create_study("s", storage, config, "loss", sampler="random", pruner="none", seed=3)  # resumes
    with pytest.raises(ValueError, match="exists with other settings"):
        studies.create_study("s", storage, config, "loss", sampler="tpe", pruner="none", seed=3)
    assert study.study_name == "s"


@pytest.mark.parametrize("call, words", [
    (lambda c, s: studies.create_study("x", s, c, "speed_memory"), "objective must be one of"),
    (lambda c, s: studies.create_study("x", s, c, "speed", pruner="median"), "reports no intermediate values"),
    (lambda c, s: studies.create_study("x", s, c, "speed", fixed=FITS), "for objective 'loss' only"),
    (lambda c, s: studies.create_study("x", s, c, "loss", fixed={"technique": "warp"}), "technique must be one of"),
    (lambda c, s: studies.create_study("x", s, c, "loss", sampler="grid"), "sampler must be one of"),
    (lambda c, s: studies.create_study("x", s, c, "loss", pruner="patient"), "pruner must be one of"),
    (lambda c, s: studies.create_study("x", s, c, "loss", sampler="replay"), "at least one setting"),
])
def test_bad_names_are_refused_before_anything_is_stored(call, words, config, storage):
    with pytest.raises(ValueError, match=words):
        call(config, storage)
    assert "x" not in optuna.get_all_study_names(storage)


def test_the_loss_objective_sets_the_budget_constraint(config, storage):
    study = studies.create_study("c", storage, config, "loss", sampler="tpe", pruner="none")
    fn = studies.objective(study)
    fits, not_fits = optuna.trial.FixedTrial(FITS), optuna.trial.FixedTrial(DOES_NOT_FIT)
    assert fn(fits) < search.untrained_loss(config)
    assert fits.constraints["peak_over_budget_bytes"] <= 0 and fits.user_attrs["status"] == "ok"
    assert fn(not_fits) == search.untrained_loss(config)  # not trained
    assert not_fits.constraints["peak_over_budget_bytes"] > 0 and not_fits.user_attrs["status"] == "predicted_oom"
    assert not_fits.user_attrs["steps_run"] == 0


def test_best_trial_is_the_best_that_fits(config, storage):
    """An infeasible trial with a lower value must not be the best: Optuna reads the constraints."""
    study = studies.create_study("b", storage, config, "loss", sampler="random", pruner="none")
    for params in (FITS, DOES_NOT_FIT):
        study.enqueue_trial(params)
    studies.optimize(study, 2)
    fitting, skipped = study.trials
    assert study.best_trial.number == fitting.number
    dist = {k: v for k, v in fitting.distributions.items()}
    cheat = optuna.trial.create_trial(params=FITS, distributions=dist, value=0.0,
                                      constraints={"peak_over_budget_bytes": 1.0})
    study.add_trial(cheat)  # a better value that does not fit
    assert study.best_trial.number == fitting.number
    assert studies.feasible(fitting) and not studies.feasible(skipped)


def test_pruned_trials_record_their_steps(config, storage):
    study = studies.create_study("p", storage, config, "loss", sampler="random", pruner="median", startup_trials=1)
    study.enqueue_trial(FITS)
    study.enqueue_trial(dict(FITS, lr=1e-4))  # learns less: pruned after half the steps
    studies.optimize(study, 2)
    first, second = study.trials
    assert first.state == TrialState.COMPLETE and second.state == TrialState.PRUNED
    assert second.user_attrs["steps_run"] == config.train_steps // 2 < first.user_attrs["steps_run"]
    assert second.user_attrs["peak_bytes"] == second.user_attrs["predicted_peak_bytes"]


def test_the_speed_objective_times_what_fits_and_scores_the_rest_zero(config, storage):
    study = studies.create_study("m", storage, config, "speed", sampler="tpe", pruner="none")
    fn = studies.objective(study)
    knobs = {k: v for k, v in DOES_NOT_FIT.items() if k != "lr"}
    small, big = optuna.trial.FixedTrial({"technique": "l2l"}), optuna.trial.FixedTrial(knobs)
    assert fn(small) > 0 and small.user_attrs["status"] == "ok" and small.user_attrs["tokens_per_s"] > 0
    assert small.constraints["peak_over_budget_bytes"] <= 0
    assert small.user_attrs["peak_bytes"] == search.predict_peak_bytes(FITS, config)  # measured, under the budget
    assert fn(big) == 0.0 and big.user_attrs["status"] == "predicted_oom"  # not run: no time to measure
    assert big.constraints["peak_over_budget_bytes"] > 0


def test_the_fastest_feasible_trial_is_the_best(config, storage):
    """A faster setting that does not fit must not be the best: Optuna reads the constraints."""
    study = studies.create_study("f", storage, config, "speed", sampler="random", pruner="none")
    study.enqueue_trial({"technique": "l2l"})
    studies.optimize(study, 1)
    fitting = study.trials[0]
    cheat = optuna.trial.create_trial(params={"technique": "l2l"}, distributions=fitting.distributions,
                                      value=fitting.value * 10, constraints={"peak_over_budget_bytes": 1.0})
    study.add_trial(cheat)
    assert study.best_trial.number == fitting.number


def test_a_learning_rate_study_draws_only_the_learning_rate(config, storage):
    knobs = {"technique": "checkpoint", "segments": 1, "precision": "fp32", "micro_batch": 4}
    study = studies.create_study("lr", storage, config, "loss", sampler="random", pruner="none", fixed=knobs)
    studies.optimize(study, 2)
    assert all(set(t.params) == {"lr"} for t in study.trials)
    assert all(t.user_attrs["status"] == "ok" and t.state == TrialState.COMPLETE for t in study.trials)
    assert studies.load_study("lr", storage).user_attrs["settings"]["fixed"] == knobs


def test_a_pruner_never_stops_a_trial_at_its_last_step(config, storage):
    """Only the validations before the last are reported: a finished trial is never marked PRUNED."""
    study = studies.create_study("z", storage, config, "loss", sampler="replay", pruner="median", startup_trials=1,
                                 replay=[FITS, dict(FITS, lr=1e-4)])
    studies.optimize(study, 2)
    reported = [sorted(t.intermediate_values) for t in study.trials]
    assert all(max(steps) < config.train_steps for steps in reported), reported


def test_median_pruner_warm_up_is_the_documented_one(config):
    pruner = studies.make_pruner("median", studies.warmup_steps(config))
    assert studies.warmup_steps(config) == 2 == config.train_steps // 2
    assert pruner._n_warmup_steps == 2  # MedianPruner compares from step n_warmup_steps on (Optuna's docs)


def test_replay_gives_trial_i_setting_i(config, storage):
    settings = [FITS, dict(FITS, lr=2e-3), dict(FITS, lr=3e-3)]
    study = studies.create_study("r", storage, config, "loss", sampler="replay", pruner="none", replay=settings)
    studies.optimize(studies.load_study("r", storage), 4)
    assert [t.params for t in study.trials] == settings + settings[:1]


def test_optimize_stops_at_the_total(config, storage):
    study = studies.create_study("t", storage, config, "loss", sampler="replay", pruner="none", replay=[FITS])
    assert studies.optimize(study, 10, total_trials=3) == 3
    assert studies.optimize(study, 10, total_trials=3) == 0  # resumed: nothing left to do
    assert len(study.trials) == 3


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # study.ask() below: a trial outside optimize
def test_optimize_waits_for_a_silent_trial_and_runs_its_retry(config, storage):
    """The total is reached, but a trial is still RUNNING: once its heartbeat is stale it is retried here."""
    study = studies.create_study("w", storage, config, "loss", sampler="replay", pruner="none", replay=[FITS])
    assert studies.optimize(study, 1) == 1
    silent = study.ask()  # a trial whose worker beat once and died
    storage.record_heartbeat(silent._trial_id)
    assert studies.optimize(study, 5, total_trials=1) == 1  # nothing new: only the silent trial's retry
    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert study.trials[2].system_attrs["failed_trial"] == silent.number
    assert studies.lost_trials(study) == []


def _dead_worker_trials(url: str, name: str, n: int = 1) -> list[int]:
    """Have a worker process start `n` trials (marked, never a heartbeat) and exit; return their numbers."""
    code = ("import sys; from labkit.search import storage as db, study as s, workers as w\n"
            "st = s.load_study(sys.argv[2], db.make_storage(sys.argv[1]))\n"
            "for _ in range(int(sys.argv[3])):\n"
            "    t = st.ask(); w.mark_worker(t); print(t.number)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code, url, name, str(n)], check=True,
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return [int(x) for x in out.stdout.split()]  # run() reaped it: its pid names no process now


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")
def test_a_local_workers_death_is_seen_without_a_heartbeat(config, tmp_path, monkeypatch):
    """A worker killed before its heartbeat thread wrote once (seen: that thread crashed) leaves no heartbeat."""
    url = stores.sqlite_url(tmp_path / "d.db")
    study = studies.create_study("p", stores.make_storage(url, heartbeat_s=1, grace_s=2), config, "loss",
                                 sampler="replay", pruner="none", replay=[FITS])
    assert studies.optimize(study, 1) == 1
    [silent] = _dead_worker_trials(url, "p")
    waits = []
    monkeypatch.setattr(workers.time, "sleep", lambda s: waits.append(s))
    assert studies.optimize(study, 5, total_trials=1) == 1  # its retry, at once: no grace period to wait out
    assert waits == []  # never polled for the dead worker's trial: seen dead at once, whatever the machine's speed
    assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert study.trials[2].system_attrs["failed_trial"] == silent
    assert workers.worker_of(study.trials[2])["pid"] == os.getpid()  # the retry's own worker, recorded first


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")
def test_a_retry_is_not_failed_for_the_dead_worker_it_copied(config, tmp_path):
    """The retry copies the dead trial's user attributes: a third worker must not take them for the retry's worker."""
    url = stores.sqlite_url(tmp_path / "r.db")
    storage = stores.make_storage(url, heartbeat_s=1, grace_s=2)
    study = studies.create_study("r", storage, config, "loss", sampler="replay", pruner="none", replay=[FITS])
    [dead] = _dead_worker_trials(url, "r")
    assert workers.fail_dead_trials(study) == [dead]
    retry = study.ask()  # a live worker pops the retry; its objective has not recorded it yet
    frozen = study.trials[retry.number]
    assert frozen.system_attrs["failed_trial"] == dead and frozen.user_attrs["worker"]["pid"]  # the copy
    assert workers.worker_of(frozen) is None  # written for another trial
    assert workers.fail_dead_trials(study) == []  # the third worker leaves it alone
    assert study.trials[retry.number].state == TrialState.RUNNING


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")
def test_another_machines_trial_is_not_failed_here(config, storage):
    """Machines cloned from one image share a hostname: only the machine id tells whose pid a trial names."""
    import socket

    study = studies.create_study("o", storage, config, "loss", sampler="replay", pruner="none", replay=[FITS])
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that names no process here
    for machine in ("linux:another-boot:pid:[1]", machine_id()):
        t = study.ask()
        t.set_user_attr("worker", {"trial": t.number, "host": socket.gethostname(), "pid": gone.pid,
                                   "machine": machine, "start": None})
    assert workers.fail_dead_trials(study) == [1]  # this machine's dead worker only
    assert [t.state for t in study.trials] == [TrialState.RUNNING, TrialState.FAIL, TrialState.WAITING]


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")
def test_a_worker_waits_for_a_live_trial_at_most_max_wait_s(config, storage):
    study = studies.create_study("m", storage, config, "loss", sampler="replay", pruner="none", replay=[FITS])
    busy = study.ask()  # this very process runs it: it is alive (and without a heartbeat, never stale)
    workers.mark_worker(busy)
    start = time.monotonic()
    assert studies.optimize(study, 5, total_trials=0, max_wait_s=1.5) == 0
    assert 1.5 <= time.monotonic() - start < 10  # (a storage query on a loaded 2-core machine: seconds at worst)
    assert study.trials[0].state == TrialState.RUNNING  # not failed: its worker lives


def test_optimize_does_not_wait_without_heartbeats(config):
    study = studies.create_study("n", optuna.storages.InMemoryStorage(), config, "loss", sampler="replay",
                                 pruner="none", replay=[FITS])
    study.ask()  # running for ever: nobody could ever tell it died
    assert studies.optimize(study, 5, total_trials=0) == 0


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_lost_trials_counts_failures_no_retry_completed(config, storage):
    study = studies.create_study("l", storage, config, "loss", sampler="random", pruner="none")
    dist = optuna.distributions.FloatDistribution(1e-4, 3e-2, log=True)
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, params={"lr": 1e-3}, distributions={"lr": dist}))
    assert studies.lost_trials(study) == [0]
    # what RetryHeartbeatStaleTrialCallback enqueues: the same params, marked with the failed trial's number
    study.add_trial(optuna.trial.create_trial(params={"lr": 1e-3}, distributions={"lr": dist}, value=1.0,
                                              system_attrs={"failed_trial": 0, "retry_history": [0]}))
    assert RetryHeartbeatStaleTrialCallback.retried_trial_number(study.trials[1]) == 0
    assert studies.lost_trials(study) == []


def test_default_build_dir_is_the_repositorys(tmp_path):
    d = stores.default_build_dir()
    assert d.is_dir() and d.parts[-2:] == ("build", "search") and (d.parent.parent / "pyproject.toml").exists()
    assert stores.sqlite_url(tmp_path / "a" / "b.db").startswith("sqlite:///") and (tmp_path / "a").is_dir()


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_the_front_keeps_settings_no_other_beats_on_speed_and_memory(config, storage):
    study = studies.create_study("front", storage, config, "speed", sampler="random", pruner="none")
    dist = {"technique": optuna.distributions.CategoricalDistribution(search.space.TECHNIQUES)}
    points = [(100.0, 30), (80.0, 20), (90.0, 40), (100.0, 35), (50.0, 20), (120.0, 50), (100.0, 30)]  # speed, peak
    for tokens_per_s, peak in points:
        study.add_trial(optuna.trial.create_trial(params={"technique": "l2l"}, distributions=dist, value=tokens_per_s,
                                                  user_attrs={"peak_bytes": peak}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, params={"technique": "l2l"}, distributions=dist))
    front = studies.speed_memory_front(study.trials)
    assert [(t.value, t.user_attrs["peak_bytes"]) for t in front] == [(80.0, 20), (100.0, 30), (120.0, 50)]
    assert [t.number for t in front] == [1, 0, 5]  # a repeated point once: its first trial


def test_fresh_study_names_differ_between_processes_and_seconds():
    name = studies.fresh_study_name("fit")
    assert name.startswith("fit-") and name.endswith(f"-{os.getpid()}")


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # study.ask(): a dead worker's trial
def test_brute_force_passes_over_a_trial_killed_during_its_draw(config, storage):
    """A worker killed after drawing the technique, before the rest, leaves a FAIL trial with part of a setting."""
    space = config.space(only=search.MEMORY_KNOBS)
    dists = {p.name: optuna.distributions.CategoricalDistribution(list(p.choices)) for p in space if p.choices}
    study = studies.create_study("half", storage, config, "speed", sampler="bruteforce", seed=3)
    whole = {"technique": "none", "precision": "fp32", "micro_batch": config.batch}
    study.add_trial(optuna.trial.create_trial(params=whole, distributions={k: dists[k] for k in whole}, value=1.0))
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, params={"technique": "none"},
                                              distributions={"technique": dists["technique"]}))
    drawn = search.suggest(study.ask(), space)  # optuna's own sampler: "param_name mismatch"
    search.check_params(drawn, space)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # study.ask(): a dead worker's trial
def test_a_brute_force_speed_study_tries_every_setting_once_passing_over_a_trial_killed_before_its_draw(config, storage):
    """Every setting once, no more (a trial a setting), though a worker killed between starting a trial and drawing
    its setting left a FAIL trial without params first. (One study for both: each runs every setting. fp32 only: the
    13 settings of every technique and micro-batch, 5.5 CPU-s, against 14 with bf16's 12 more on an AVX2 CPU.)"""
    from labkit.search.space import enumerate_settings

    config = dataclasses.replace(config, precisions=("fp32",))
    everything = enumerate_settings(config.space(only=search.MEMORY_KNOBS))
    assert len(everything) == 13 and {s.get("technique") for s in everything} == {"none", "checkpoint", "offload",
                                                                                   "l2l"}
    study = studies.create_study("bare", storage, config, "speed", sampler="bruteforce", seed=2)
    bare = study.ask()  # started, nothing drawn, then its worker died
    storage.set_trial_state_values(bare._trial_id, state=TrialState.FAIL)
    studies.optimize(study, len(everything) + 5, total_trials=len(everything))
    tried = [dict(t.params) for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(tried) == len(everything) and all(s in tried for s in everything)
    others = [t for t in study.trials if t.number != bare.number]
    assert len(others) == len(everything) and all(t.state == TrialState.COMPLETE for t in others)  # no extra trial


def test_the_prediction_check_counts_verdicts_errors_repeats_and_growth():
    """labkit.search.checks on hand-made trials: what held, where a peak differs; study.repeated_settings: which trial
    repeats which setting, and why."""
    import datetime

    import optuna

    from labkit.search.checks import check_predictions
    from labkit.search.workers import WORKER_ATTR
    t0 = datetime.datetime(2026, 1, 1)

    def trial(number, knobs, status, start_s, end_s, predicted=None, peak=None, live=0, pid=1, retry_of=None):
        attrs = {"status": status, "live_tensor_bytes_at_start": live,
                 WORKER_ATTR: {"trial": number, "pid": pid, "host": "h", "start": 0}}
        if predicted is not None:
            attrs.update(predicted_peak_bytes=predicted, peak_bytes=peak)
        t = optuna.trial.create_trial(params=knobs, distributions={k: optuna.distributions.CategoricalDistribution([v])
                                                                   for k, v in knobs.items()}, value=1.0,
                                      user_attrs=attrs, system_attrs={} if retry_of is None else {"failed_trial": retry_of})
        t.number, t.datetime_start, t.datetime_complete = (number, t0 + datetime.timedelta(seconds=start_s),
                                                           t0 + datetime.timedelta(seconds=end_s))
        return t
    a, b = {"micro_batch": 8}, {"micro_batch": 4}
    trials = [trial(0, a, "ok", 0, 5, 1000, 1000, live=10), trial(1, b, "ok", 1, 3, 1010, 1000, live=10),
              trial(2, a, "ok", 2, 6, 1000, 1000, live=10, pid=2),  # a while trial 0 still ran
              trial(3, b, "oom", 7, 8, 900, 1000, live=10), trial(4, a, "ok", 9, 10, 1000, 1000, live=30),  # a again
              trial(5, {"micro_batch": 16}, "predicted", 11, 11, live=30)]
    # a 16-bit setting predicted, not run, drawn again (nothing ran it: the check never sees it), and a retry
    extra = [trial(6, {"micro_batch": 16}, "predicted", 12, 12, live=30), trial(7, {"micro_batch": 3}, "ok", 13, 14),
             trial(8, {"micro_batch": 2}, "ok", 13.5, 15, retry_of=7)]  # 7: a trial killed before it drew every knob
    assert studies.repeated_settings(trials + extra) == [(2, 0, "drawn while it ran"), (3, 1, "drawn again"),
                                                         (4, 0, "drawn again"), (6, 5, "drawn again"), (8, 7, "retry")]
    check = check_predictions(trials, config=None)  # nothing predicted not to fit: no step to run
    assert check.ran_within == [True, True, True, False, True] and check.agreement == 0.8
    assert check.peak_errors == {0: 0.0, 1: 0.01, 2: 0.0, 3: -0.1, 4: 0.0} and check.largest_error == -0.1
    assert check.predicted_only == [5]
    assert check.growth_bytes == 20  # worker 1 (trials 0, 1, 3, 4, 5): 10, 10, 10, 30, 30; from its second trial on
    assert [d[0] for d in check.details] == [1, 3]
    rows = dict(check.rows())
    assert rows["peaks exact to the byte"] == "3 of 5" and rows["trials predicted to fit, not run here"] == "#5"
