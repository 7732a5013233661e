"""labkit.techniques.l2l trains layer to layer exactly like plain training, with a device peak constant in depth.

Notebook 05 runs in tests/test_nb05.py.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch

import labkit
from labkit import compare
from labkit.compare import max_param_diff
from labkit.data import TeacherTask
from labkit.stages import split_stages
from labkit.techniques import l2l
from labkit.techniques.l2l import L2LTrainer, measure_l2l_step
from labkit.work import count_work

CPU = torch.device("cpu")


@pytest.fixture
def gpt(tiny_gpt):
    """Return make(seed=0, **overrides): the tiny GPT with 4 heads (head width 8: rope-able)."""
    return lambda seed=0, **overrides: tiny_gpt(seed, **{"n_head": 4, **overrides})


def _train_both(model, batches, seed_each_step=False):
    """Train a plain copy and an L2L copy of `model` on the same batches; return (plain, trainer, losses)."""
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    trainer = L2LTrainer(copy.deepcopy(model), CPU)
    losses = []
    for i, b in enumerate(batches):
        if seed_each_step:
            torch.manual_seed(100 + i)
        lp = labkit.train_step(plain, opt, b)
        if seed_each_step:
            torch.manual_seed(100 + i)
        ll = trainer.step(b)
        losses.append((lp.item(), ll.item()))
    return plain, trainer, losses


def test_gpt_with_tied_weights_matches_plain_training(tiny_batch, gpt):
    model = gpt(1, n_layer=3)
    assert model.head.weight is model.tok_emb.weight
    plain, trainer, losses = _train_both(model, [tiny_batch(4, seed=1 + i) for i in range(4)])
    assert max_param_diff(trainer.model, plain) <= 1e-6
    assert max_param_diff(trainer.model, plain, relative=True) <= 1e-5
    assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in losses)
    assert max_param_diff(trainer.model, model) > 1e-4  # it did train


def test_dropout_untied_llama_options_and_padding_match_plain_training(tiny_batch, gpt):
    model = gpt(2, n_layer=3, dropout=0.2, tie_weights=False, mlp="swiglu", norm="rms", pos="rope", bias=False)
    batches = [tiny_batch(4, seed=2 + i, padded=True) for i in range(3)]
    plain, trainer, _ = _train_both(model, batches, seed_each_step=True)
    assert max_param_diff(trainer.model, plain) <= 1e-6


def test_mlp_matches_plain_training():
    torch.manual_seed(3)
    model = labkit.MLP(labkit.MLPConfig(depth=3, hidden=64))
    task = TeacherTask(seed=3)
    plain, trainer, _ = _train_both(model, [task.batch(16) for _ in range(3)])
    assert max_param_diff(trainer.model, plain) <= 1e-6


def test_without_dropout_replay_masks_differ(tiny_batch, gpt):
    """The recomputed forward must see the same dropout masks: without replay, gradients go wrong."""
    model = gpt(4, dropout=0.3)
    trainer = L2LTrainer(copy.deepcopy(model), CPU)
    trainer._dropout = [False] * len(trainer.stages)  # switch the RNG replay off
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    b = tiny_batch(4, 16, seed=4)
    torch.manual_seed(7)
    labkit.train_step(plain, opt, b)
    torch.manual_seed(7)
    trainer.step(b)
    assert max_param_diff(trainer.model, plain) > 1e-5


def test_device_peak_is_flat_in_depth_and_plain_grows(tiny_batch, gpt):
    b = tiny_batch(4, seed=5)
    l2l, plain = {}, {}
    for depth in (1, 4, 8):
        model = gpt(5, n_layer=depth)
        trainer = L2LTrainer(copy.deepcopy(model), CPU)
        l2l[depth] = measure_l2l_step(trainer, b, timeline=False).peak_bytes
        opt = labkit.make_optimizer("adam", model.parameters())
        plain[depth] = labkit.measure_step(model, opt, b).peak_bytes
    assert max(l2l.values()) / min(l2l.values()) <= 1.01, l2l
    assert plain[1] < plain[4] < plain[8], plain
    assert l2l[8] < plain[8] / 3


def test_host_tier_holds_model_and_adam_state_and_the_device_ends_empty(tiny_batch, gpt):
    model = gpt(6)
    trainer = L2LTrainer(model, CPU)
    b = tiny_batch(4, 16, seed=6)
    trainer.step(b)  # Adam's state exists now
    n_params = labkit.count_params(model)
    with labkit.MemoryMeter(CPU) as meter:
        trainer.attach(meter)
        meter.track(*b)
        batch_bytes = meter.current_bytes
        trainer.step(b)
        after_bytes = meter.current_bytes
    split = meter.peak_split()
    assert split["optimizer_state"] == 0
    assert 0 < split["parameters"] < 4 * n_params  # never the whole model at once
    assert meter.host_peak_bytes >= 16 * n_params  # weights, gradients, m, v
    assert after_bytes == batch_bytes  # nothing of the model is left on the device
    assert all(p.grad is None for p in trainer.model.parameters())


def test_budget_fits_where_plain_does_not_and_oom_leaves_the_trainer_usable(tiny_batch, gpt):
    model = gpt(7, n_layer=4)
    b = tiny_batch(8, 16, seed=7)
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    plain_peak = labkit.measure_step(plain, opt, b).peak_bytes
    budget = plain_peak // 2
    assert not labkit.try_fit(labkit.measure_step, plain, opt, b, budget_bytes=budget).fits
    trainer = L2LTrainer(copy.deepcopy(model), CPU)
    fit = labkit.try_fit(measure_l2l_step, trainer, b, budget)
    assert fit.fits and fit.value.peak_bytes <= budget
    tiny = labkit.try_fit(measure_l2l_step, trainer, b, 4096)
    assert not tiny.fits and isinstance(tiny.error, labkit.OutOfMemory)
    assert all(p.grad is None for p in trainer.model.parameters())  # no half-step gradients left behind
    assert torch.isfinite(trainer.step(b))


def test_moved_bytes_follow_the_formula(tiny_batch, gpt):
    model = gpt(8, n_layer=3)
    trainer = L2LTrainer(model, CPU)
    B, T, C = 4, 16, model.cfg.n_embd
    trainer.step(tiny_batch(B, T, seed=8))
    stage_bytes = [sum(p.nbytes for p in s.parameters()) for s in trainer.stages]
    n = len(stage_bytes)
    boundary = (n - 2) * B * T * C * 4
    assert trainer.moved_bytes["host_to_device"] == 2 * sum(stage_bytes[:-1]) + stage_bytes[-1] + boundary
    assert trainer.moved_bytes["device_to_host"] == sum(stage_bytes) + boundary


def test_flops_add_at_most_one_forward(tiny_batch, gpt):
    model = gpt(9, n_layer=3)
    b = tiny_batch(4, 16, seed=9)
    plain = copy.deepcopy(model)
    opt = labkit.make_optimizer("adam", plain.parameters())
    f_plain = count_work(labkit.train_step, plain, opt, b).total_flops
    f_l2l = count_work(L2LTrainer(model, CPU).step, b).total_flops
    assert 1.0 < f_l2l / f_plain <= 4 / 3 + 1e-9


def test_trainer_refuses_batchnorm_and_other_models():
    with pytest.raises(ValueError, match="BatchNorm"):
        L2LTrainer(labkit.MLP(labkit.MLPConfig(batchnorm=True)), CPU)
    with pytest.raises(TypeError, match="GPT and MLP"):
        L2LTrainer(torch.nn.Linear(2, 2), CPU)


def test_prefetch_on_a_cpu_holds_the_next_stage_and_changes_no_number(tiny_batch, gpt):
    """CPU prefetch: CUDA's order of copies, synchronous: the peak gains one stage's weights, the step is the same."""
    model, b = gpt(11, n_layer=3), tiny_batch(4)
    runs = {}
    for prefetch in (False, True):
        trainer = L2LTrainer(copy.deepcopy(model), CPU, prefetch=prefetch)
        runs[prefetch] = (measure_l2l_step(trainer, b, timeline=False).peak_bytes,
                          [p.detach().clone() for p in trainer.model.parameters()])
    largest_stage = max(sum(t.nbytes for t in s.parameters()) for s in L2LTrainer(model, CPU).stages)
    assert 0 < runs[True][0] - runs[False][0] <= largest_stage
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))


def test_peak_stage_names_the_visit_that_set_the_meter_peak(tiny_batch, gpt):
    trainer = L2LTrainer(gpt(), CPU)
    assert trainer.stage_names == ["embedding", "block 1", "block 2", "head"]
    b = tiny_batch(4)
    trainer.step(b)
    assert trainer.peak_stage is None  # no meter: nothing to attribute
    meter = measure_l2l_step(trainer, b, timeline=False)
    phase, stage = trainer.peak_stage
    assert phase in ("forward", "backward") and stage in trainer.stage_names
    assert meter.peak_bytes > 0


_REAL_TO_DEVICE = l2l.to_device


# -- CUDA prefetch: a weight copy still queued on the side stream must be waited for before its memory goes ---
class _FakeCuda:
    """CPU stand-ins for torch.cuda's streams and events; they log which side-stream copies the compute stream awaited.

    Copy number c is issued on the side stream; an event recorded there marks every copy issued so far;
    `compute.wait_event(e)` and `compute.wait_stream(side)` move the compute stream's horizon forward. A
    weight copy whose device tensor is freed while its number is beyond that horizon is a violation: on a
    GPU the caching allocator could hand its block to the compute stream while the copy still writes it.
    """

    def __init__(self, monkeypatch, fail_at: int | None = None):
        self.issued = 0  # copies issued on the side stream
        self.waited = 0  # the compute stream has waited for copies 1 .. waited
        self.recorded = []  # the copy number each event recorded on the side stream marks
        self.violations = []  # copies whose destination was freed before the compute stream waited for them
        self.released = 0  # weight copies whose device tensor is gone
        self.calls = 0  # to_device calls (weights and boundary activations)
        self.fail_at = fail_at  # raise at this to_device call (None: never)
        self.side, self.compute = _FakeStream(self, "side"), _FakeStream(self, "compute")
        fake = self

        class Event:
            def record(self, stream):
                assert stream is fake.side
                self.fake, self.mark = fake, fake.issued
                fake.recorded.append(self.mark)

        def to_device(h, device, pool=None, stream=None):
            fake.calls += 1
            if fake.calls == fake.fail_at:
                raise RuntimeError("injected failure")
            x = _REAL_TO_DEVICE(h, device, pool=pool, stream=stream)  # the real code path, through the fakes
            if stream is not None:
                weakref.finalize(x, fake.freed, fake.issued)
            return x

        @contextlib.contextmanager
        def stream_context(stream):
            assert stream is fake.side
            fake.issued += 1  # to_device issues one copy inside the side-stream context
            yield

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.compute)
        monkeypatch.setattr(torch.cuda, "stream", stream_context)
        monkeypatch.setattr(l2l, "to_device", to_device)

    def freed(self, copy_number: int):
        self.released += 1
        if copy_number > self.waited:
            self.violations.append(copy_number)

    def trainer(self, model) -> L2LTrainer:
        """Return a CPU trainer whose weight fetches take the prefetch path through these fakes."""
        trainer = L2LTrainer(model, CPU, prefetch=False)
        trainer.prefetch, trainer._copy_stream = True, self.side
        return trainer

    def assert_every_copy_waited_for(self, released: bool = True):
        """Assert that the compute stream waited for every weight copy before its memory went (and that all went)."""
        if released:
            gc.collect()  # frames a traceback kept
        assert self.violations == [], f"copies freed before the compute stream waited for them: {self.violations}"
        assert self.waited == self.issued, f"the compute stream waited for {self.waited} of {self.issued} weight copies"
        if released:
            assert self.released == self.issued, f"{self.issued - self.released} weight copies still hold device memory"


class _FakeStream:
    def __init__(self, fake: _FakeCuda, name: str):
        self.fake, self.name = fake, name

    def wait_stream(self, other):
        if self.name == "compute" and other is self.fake.side:
            self.fake.waited = max(self.fake.waited, self.fake.issued)

    def wait_event(self, event):
        assert self.name == "compute"
        if event.fake is self.fake:  # (not an event of another test's trainer, finalised late)
            self.fake.waited = max(self.fake.waited, event.mark)


def test_prefetch_through_fake_streams_trains_like_the_plain_step(monkeypatch, tiny_batch, gpt):
    fake = _FakeCuda(monkeypatch)
    model = gpt(12, n_layer=3)
    trainer, plain = fake.trainer(copy.deepcopy(model)), L2LTrainer(copy.deepcopy(model), CPU)
    b = tiny_batch(4, seed=12)
    assert trainer.step(b).item() == plain.step(b).item()
    assert max_param_diff(trainer.model, plain.model) == 0
    assert len(fake.recorded) == 2 * len(trainer.stages) - 1  # one event per visit
    fake.assert_every_copy_waited_for()


@pytest.mark.parametrize("where", ["head loss", "block forward", "block backward"])
def test_a_failing_step_waits_for_every_queued_weight_copy(monkeypatch, tiny_batch, gpt, where):
    fake = _FakeCuda(monkeypatch)
    trainer = fake.trainer(gpt(13, n_layer=3))
    x, y = tiny_batch(4, seed=13)
    block, calls = trainer.stages[2], []
    forward = block.forward

    def failing_forward(h):
        calls.append(1)
        if (where == "block forward" and len(calls) == 1) or (where == "block backward" and len(calls) == 2):
            raise RuntimeError("injected failure")
        return forward(h)

    monkeypatch.setattr(block, "forward", failing_forward)
    bad = (x, y[:, :-1]) if where == "head loss" else (x, y)  # a wrong target shape: the head's loss raises
    with pytest.raises((RuntimeError, ValueError)) as failure:
        trainer.step(bad)
    fake.assert_every_copy_waited_for(released=False)  # at once, while the traceback keeps the step's frames
    del failure
    fake.assert_every_copy_waited_for()


def test_a_copy_failing_anywhere_in_the_step_leaves_no_weight_copy_unwaited(monkeypatch, tiny_batch, gpt):
    """Fail the n-th host-to-device copy for every n: inside a fetch, between visits, on a boundary activation."""
    count = _FakeCuda(monkeypatch)
    model, b = gpt(14, n_layer=1), tiny_batch(4, seed=14)
    count.trainer(copy.deepcopy(model)).step(b)
    for n in sorted({*range(1, count.calls + 1, 3), count.calls}):  # every third copy, and the last
        fake = _FakeCuda(monkeypatch, fail_at=n)
        with pytest.raises(RuntimeError, match="injected") as failure:
            fake.trainer(model).step(b)  # (a failed step leaves the model as it was)
        fake.assert_every_copy_waited_for(released=False)
        del failure
        fake.assert_every_copy_waited_for()


def test_closing_the_weight_generator_early_waits_for_the_prefetched_copy(monkeypatch, gpt):
    fake = _FakeCuda(monkeypatch)
    trainer = fake.trainer(gpt(15, n_layer=2))
    weights = trainer._weights([0, 1, 2])
    next(weights)  # stage 0 is on the device; stage 1's copy is queued
    assert fake.waited < fake.issued
    weights.close()
    fake.assert_every_copy_waited_for()


# -- many micro-batches per visit (the paper's schedule) ------------------------------------------------
def _l2l_grads(trainer, batch, micro_batches):
    """Run one step; return (loss, the host gradients the optimizer would have stepped with)."""
    captured = {}
    trainer.optimizer.step = lambda: captured.update(compare.grads(trainer.model))  # capture instead of stepping
    loss = trainer.step(batch, micro_batches=micro_batches)
    return loss, captured


def _plain_grads(model, batch):
    model = copy.deepcopy(model)
    _, loss = model(*batch)
    loss.backward()
    return loss.detach(), compare.grads(model)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_micro_batched_gradients_equal_the_plain_step(tiny_batch, gpt, k):
    """Padded rows hold different numbers of real tokens, and 5 rows split unevenly: each micro-batch's
    loss must weigh by its share of the real targets."""
    model = gpt(16, n_layer=3)
    b = tiny_batch(5, seed=16, padded=True)
    counts = [int((t != -100).sum()) for t in b[1].tensor_split(k)]
    assert k == 1 or len(set(counts)) > 1  # the naive 1/k weighting would be wrong here
    loss, grads = _l2l_grads(L2LTrainer(copy.deepcopy(model), CPU), b, k)
    plain_loss, plain = _plain_grads(model, b)
    assert compare.max_rel_diff(grads, plain) <= 1e-5
    assert abs(loss.item() - plain_loss.item()) <= 1e-6 * abs(plain_loss.item())


def test_micro_batched_mlp_and_llama_options_train_like_plain(tiny_batch, gpt):
    model = gpt(17, n_layer=3, tie_weights=False, mlp="swiglu", norm="rms", pos="rope", bias=False)
    batches = [tiny_batch(8, seed=17 + i) for i in range(3)]
    plain, _, _ = _train_both(model, batches)
    trainer = L2LTrainer(copy.deepcopy(model), CPU)
    for b in batches:
        trainer.step(b, micro_batches=4)
    assert max_param_diff(trainer.model, plain) <= 1e-5
    torch.manual_seed(18)
    mlp = labkit.MLP(labkit.MLPConfig(depth=3, hidden=64))
    b = TeacherTask(seed=18).batch(12)
    _, grads = _l2l_grads(L2LTrainer(copy.deepcopy(mlp), CPU), b, 3)
    assert compare.max_rel_diff(grads, _plain_grads(mlp, b)[1]) <= 1e-5


def test_micro_batched_dropout_masks_are_replayed_per_micro_batch(tiny_batch, gpt):
    """Reference: autograd over the same stage-major order of micro-batches, so the RNG draws the same masks."""
    model, k = gpt(19, n_layer=3, dropout=0.3), 3
    x, y = b = tiny_batch(6, seed=19)
    trainer = L2LTrainer(copy.deepcopy(model), CPU)
    torch.manual_seed(20)
    _, grads = _l2l_grads(trainer, b, k)
    ref = copy.deepcopy(model)
    stages = split_stages(ref)
    h = list(x.tensor_split(k))
    torch.manual_seed(20)
    for i, stage in enumerate(stages[:-1]):
        for j in L2LTrainer._walk(i, k):
            h[j] = stage(h[j])
    loss = sum(stages[-1](hj, yj) * (yj.numel() / y.numel()) for hj, yj in zip(h, y.tensor_split(k)))
    loss.backward()
    assert compare.max_rel_diff(grads, compare.grads(ref)) <= 1e-5
    torch.manual_seed(20)
    _, other_order = _l2l_grads(L2LTrainer(copy.deepcopy(model), CPU), b, 2)
    assert compare.max_rel_diff(other_order, grads) > 1e-3  # other masks: the comparison above can fail


def _moved_formula(stage_bytes, boundary_bytes, k):
    """Return (host_to_device, device_to_host) for one step with k equal micro-batches; boundary_bytes: the batch's."""
    n = len(stage_bytes)
    b, r = boundary_bytes, boundary_bytes * (k - 1) // k  # r: all micro-batches but the one kept on the device
    h2d = 2 * sum(stage_bytes[:-1]) + stage_bytes[-1] + (n - 2) * b + (2 * n - 2) * r
    d2h = sum(stage_bytes) + (n - 2) * b + n * r
    return h2d, d2h


@pytest.mark.parametrize("k", [1, 2, 4])
def test_micro_batched_moved_bytes_follow_the_formula_and_weights_move_once_per_visit(tiny_batch, gpt, monkeypatch, k):
    model = gpt(21, n_layer=3)
    trainer = L2LTrainer(model, CPU)
    fetches = []
    fetch = trainer._fetch
    monkeypatch.setattr(trainer, "_fetch", lambda i: fetches.append(i) or fetch(i))
    B, T, C = 8, 16, model.cfg.n_embd
    trainer.step(tiny_batch(B, T, seed=21), micro_batches=k)
    n = len(trainer.stages)
    assert len(fetches) == 2 * n - 1  # one weight copy per visit, whatever k
    stage_bytes = [sum(p.nbytes for p in s.parameters()) for s in trainer.stages]
    h2d, d2h = _moved_formula(stage_bytes, B * T * C * 4, k)
    assert trainer.moved_bytes == {"host_to_device": h2d, "device_to_host": d2h}


def test_micro_batched_device_peak_stays_at_one_micro_batch(tiny_batch, gpt):
    """At a fixed micro-batch size, k micro-batches per visit keep the device peak; the same rows as one do not."""
    model, m = gpt(22, n_layer=3), 4
    peaks = {}
    for k in (1, 4):
        peaks[k] = measure_l2l_step(L2LTrainer(copy.deepcopy(model), CPU), tiny_batch(m * k, seed=22),
                                    timeline=False, micro_batches=k).peak_bytes
    whole = measure_l2l_step(L2LTrainer(copy.deepcopy(model), CPU), tiny_batch(4 * m, seed=22),
                             timeline=False).peak_bytes
    assert peaks[4] <= 1.25 * peaks[1], peaks  # + one stage's gradients summed over the micro-batches
    assert whole > 1.5 * peaks[4], (whole, peaks)


def test_micro_batches_are_checked(tiny_batch, gpt):
    trainer = L2LTrainer(gpt(23), CPU)
    with pytest.raises(labkit.ParameterError, match=r"micro_batches.*\[1, 4\]"):
        trainer.step(tiny_batch(4), micro_batches=5)


@pytest.mark.cuda
def test_micro_batched_prefetch_on_cuda_equals_the_plain_step(tiny_batch, gpt):
    model, b = gpt(24, n_layer=3), tiny_batch(8, seed=24, padded=True)
    cuda_batch = tuple(t.cuda() for t in b)
    _, grads = _l2l_grads(L2LTrainer(copy.deepcopy(model), "cuda", prefetch=True), cuda_batch, 4)
    assert compare.max_rel_diff(grads, _plain_grads(model, b)[1]) <= 1e-4
