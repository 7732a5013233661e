"""labkit.saved: the census of what autograd saves for backward, by tensor, storage, dtype and kind."""

from __future__ import annotations

import pytest
import torch

from labkit.saved import Census, SavedTensor, saved_tensor_census, short_dtype_name


def test_a_linear_layer_saves_its_input_and_its_weight():
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    census = saved_tensor_census(lin, lambda: torch.relu(lin(x)).sum())
    kinds = {t.kind for t in census}
    assert kinds == {"parameter", "activation"}
    params = census.where(kind="parameter")
    assert params.nbytes == lin.weight.nbytes  # addmm saves the weight (a view of it, W.t())
    acts = census.where(kind="activation")
    assert x.nbytes in {t.nbytes for t in acts}  # the input, for the weight's gradient
    assert (16, 32) in {t.shape for t in acts}  # relu's output, for its own backward
    assert [t.shape for t in census.where(kind="activation", min_bytes=x.nbytes)] == [(16, 64)]
    assert len(census.where(kind="activation", max_bytes=x.nbytes - 1)) == 1  # relu's output only
    with pytest.raises(ValueError, match="kind"):
        census.where(kind="weights")


def test_views_of_one_storage_count_once_in_storage_bytes():
    t = torch.randn(8, 8)
    first = SavedTensor(t.nbytes, (8, 8), torch.float32, "activation", (1, t.nbytes), t.nbytes)
    view = SavedTensor(t.nbytes // 2, (4, 8), torch.float32, "activation", (1, t.nbytes), t.nbytes)
    other = SavedTensor(16, (4,), torch.float32, "activation", (2, 16), 16)
    census = Census([first, view, other])
    assert census.nbytes == t.nbytes + t.nbytes // 2 + 16
    assert census.storage_nbytes == t.nbytes + 16
    assert census.by_dtype_kind() == {"fp32 activations": t.nbytes + 16}


def test_autocast_weight_copies_are_their_own_kind(tiny_gpt, tiny_batch):
    model, batch = tiny_gpt(), tiny_batch(4, seed=11)

    def forward(dtype):
        def run():
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                return model(*batch)[1]
        return run

    s32 = saved_tensor_census(model, forward(None)).by_dtype_kind()
    s16 = saved_tensor_census(model, forward(torch.bfloat16)).by_dtype_kind()
    assert not any("weight copies" in k for k in s32)
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert s16["bf16 weight copies"] == 2 * matmul_weights  # tied head counted once
    assert s16["bf16 activations"] > 0 and s32["fp32 activations"] > s16.get("fp32 activations", 0)
    assert list(s16) == sorted(s16)


def test_short_dtype_names():
    assert [short_dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == ["fp32", "bf16", "fp16"]
    assert short_dtype_name(torch.uint8) == "uint8"


def test_a_census_leaves_nothing_behind(tiny_gpt, tiny_batch):
    """The census runs a forward and no backward: its graph must be freed (saved outputs are kept detached)."""
    from labkit.meter import live_tensor_bytes

    model, batch = tiny_gpt(0), tiny_batch(4, seed=1)
    saved_tensor_census(model, lambda: model(*batch))
    before = live_tensor_bytes()
    for _ in range(3):
        census = saved_tensor_census(model, lambda: model(*batch))
        assert len(census) > 0
        del census
    assert live_tensor_bytes() == before
