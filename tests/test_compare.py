"""labkit.compare: one definition of absolute and relative differences of gradients and parameters."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from labkit.compare import flat, grads, max_abs_diff, max_grad_diff, max_param_diff, max_rel_diff, params, rel_diff


def test_rel_diff_is_norm_wise_against_the_reference():
    assert rel_diff(torch.tensor([3.0, 4.5]), torch.tensor([3.0, 4.0])) == pytest.approx(0.5 / 5.0)
    assert rel_diff(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])) == pytest.approx(0.5 / math.hypot(3, 4.5))
    assert rel_diff(torch.tensor([1e-13, 0.0]), torch.zeros(2)) == pytest.approx(0.1)  # the 1e-12 floor
    with pytest.raises(ValueError, match="shapes"):
        rel_diff(torch.zeros(2), torch.zeros(3))


def test_max_rel_diff_takes_the_worst_tensor_of_dicts_and_sequences():
    ref = {"a": torch.tensor([3.0, 4.0]), "b": torch.zeros(2)}
    g = {"a": torch.tensor([3.0, 4.5]), "b": torch.tensor([1e-13, 0.0])}
    assert max_rel_diff(g, ref) == pytest.approx(0.1)
    assert max_rel_diff(list(g.values()), list(ref.values())) == pytest.approx(0.1)
    assert max_rel_diff(ref, ref) == 0.0
    with pytest.raises(ValueError, match="names"):
        max_rel_diff({"a": ref["a"]}, ref)
    with pytest.raises(ValueError, match="length"):
        max_rel_diff([ref["a"]], list(ref.values()))
    with pytest.raises(TypeError):
        max_rel_diff(ref, list(ref.values()))


def test_max_abs_diff_is_elementwise():
    a = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([0.5])}
    b = {"w": torch.tensor([[1.0, 2.25], [3.0, 3.0]]), "b": torch.tensor([0.5])}
    assert max_abs_diff(a, b) == 1.0
    assert max_abs_diff(torch.tensor([1e-30]), torch.tensor([0.0])) == pytest.approx(1e-30)
    x, y = torch.tensor([1.0 + 2**-20]), torch.tensor([1.0])
    assert max_abs_diff(x, y) == 2**-20  # exact in fp32: a difference of two close fp32 values
    assert max_abs_diff(torch.zeros(0), torch.zeros(0)) == 0.0


def test_a_missing_gradient_on_one_side_is_an_infinite_difference():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    a(torch.randn(1, 2)).sum().backward()
    assert max_grad_diff(a, b) == math.inf
    assert max_grad_diff(a, b, relative=True) == math.inf
    assert max_grad_diff(b, b) == 0.0  # no gradient on either side: nothing differs


def test_grads_and_params_are_copies_by_name():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model(torch.randn(4, 3)).sum().backward()
    g, p = grads(model), params(model)
    assert list(g) == [name for name, _ in model.named_parameters()] == list(p)
    model[0].weight.grad.add_(1.0)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert max_grad_diff(model, model) == 0.0
    assert max_abs_diff(grads(model), g) == pytest.approx(1.0)
    assert max_abs_diff(params(model), p) == pytest.approx(1.0)


def test_max_param_diff_between_two_models():
    torch.manual_seed(0)
    a = nn.Linear(4, 4)
    b = nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    assert max_param_diff(a, b) == 0.0
    with torch.no_grad():
        b.bias[0] += 0.25
    assert max_param_diff(a, b) == pytest.approx(0.25)
    assert max_param_diff(a, b, relative=True) == pytest.approx(rel_diff(a.bias, b.bias))


def test_flat_is_a_copy_of_every_tensor_in_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    w = flat(model)
    assert w.shape == (3 * 2 + 2 + 2 * 1 + 1,)
    assert torch.equal(w, torch.cat([model[0].weight.reshape(-1), model[0].bias, model[1].weight.reshape(-1),
                                     model[1].bias]).detach())
    with torch.no_grad():
        model[1].bias.add_(1.0)  # the copy does not follow the model
    assert torch.equal(flat(model)[:-1], w[:-1]) and flat(model)[-1] == w[-1] + 1.0
    assert not w.requires_grad
    model(torch.randn(4, 3)).sum().backward()
    model[0].bias.grad = None  # a parameter without a gradient is skipped
    g = flat(grads(model))
    assert torch.equal(g, torch.cat([model[0].weight.grad.reshape(-1), model[1].weight.grad.reshape(-1),
                                     model[1].bias.grad]))
    assert torch.equal(flat([model[1].bias.grad, None, model[1].weight.grad]),  # a sequence, in its own order
                       torch.cat([model[1].bias.grad, model[1].weight.grad.reshape(-1)]))
    with pytest.raises(ValueError, match="at least one tensor"):
        flat([None])
