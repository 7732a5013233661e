"""The planner's and the search's fake tensor mode: estimate's lean mode, each cached operator's output made in one go.

A plan runs hundreds of fake steps. Torch's fake mode makes an operator's output from its cache entry through
FakeTensor(), which checks its arguments and sets fifteen attributes one by one: 15% of the 7B plan's fake steps
(2026-12-04). FastFakeTensorMode makes a dense output as FakeTensor() would, in one go; anything else, and any torch
whose new fake tensors differ from what it expects, goes through torch's own code. It also runs `aten._unsafe_view`
(every matmul of a 3-d input ends in one) as `aten.view`, which torch's fake mode computes alike but caches (it runs
each unsafe view anew: 22 ms of a 3-block Llama-style fake step of 300, 2026-12-04). direct_dispatch gives the mode
itself, the step's meter and its work counter without the wrapper torch puts around every dispatch mode's
__torch_dispatch__.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode, _DispatchCacheEntryOutputInfo

from labkit.estimate import LeanFakeTensorMode, fake_mode

_UNSAFE_VIEW, _VIEW = torch.ops.aten._unsafe_view.default, torch.ops.aten.view.default
_OWN = ("_fake_device", "fake_mode")  # what FakeTensor() sets that is not None: each output's own
_DIRECT: dict = {}  # dispatch mode class -> its direct_dispatch subclass


class FastFakeTensorMode(LeanFakeTensorMode):
    """LeanFakeTensorMode that makes a cached dense output itself (use fast_fake_mode: it checks this torch first)."""

    fresh: dict = {}  # the other attributes FakeTensor() sets on a new fake tensor, all None (fast_fake_mode's)
    views_unsafe: bool = False  # run aten._unsafe_view as aten.view: where torch's fake mode runs both by one function

    def dispatch(self, func, types, args=(), kwargs=None):
        # an unsafe view is a view autograd does not track; below autograd, on fake tensors, the same alias
        return super().dispatch(_VIEW if func is _UNSAFE_VIEW and self.views_unsafe else func, types, args, kwargs)

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        m = entry.metadata
        if entry.inplace_idx is not None or m is None or self.shape_env is not None or m.layout is not torch.strided \
                or m.is_conj or m.is_neg or not isinstance(func, torch._ops.OpOverload):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        # no dispatch mode or subclass sees the meta tensor made (torch's in_kernel_invocation_manager less its
        # meta-dispatch flag, which operators on meta tensors do not need, and its in_kernel_invocation flag, which
        # only fake tensors' device queries read: none here; its Python context manager was 7% of a fake step)
        with torch._C._DisableTorchDispatch():
            elem = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta", requires_grad=m.requires_grad)
            if func.is_view:  # a view shares its input's storage
                elem.set_(args[entry.view_idx].untyped_storage(), m.storage_offset, m.shape, m.stride)
        out = torch.Tensor._make_subclass(FakeTensor, elem, m.requires_grad, dispatch_device=True,
                                          device_for_backend_keys=m.device)
        (torch._C._set_warn_deprecated_on_mutable_data_ptr if self._allow_unsafe_data_ptr_access
         else torch._C._set_throw_on_mutable_data_ptr)(out)
        out.__dict__.update(self.fresh, _fake_device=m.device, fake_mode=self)
        return out


def fast_fake_mode(**kwargs) -> FakeTensorMode:
    """Return a FastFakeTensorMode(**kwargs) (its direct_dispatch subclass) where this torch's FakeTensor() sets what
    it expects (its device, its mode, the rest None), else fake_mode(**kwargs): the same figures either way."""
    mode = fake_mode(**kwargs)
    if type(mode) is not LeanFakeTensorMode or FakeTensorConfig.debug:
        return mode
    made = dict(FakeTensor(mode, torch.empty(0, device="meta"), torch.device("cpu")).__dict__)
    own = made.pop(_OWN[0], None) is not None and made.pop(_OWN[1], None) is mode
    entry = {f.name for f in dataclasses.fields(_DispatchCacheEntryOutputInfo)}
    if not own or any(v is not None for v in made.values()) or not {"inplace_idx", "metadata", "view_idx"} <= entry:
        return mode
    FastFakeTensorMode.fresh = made
    from torch._subclasses.fake_impls import op_implementations_dict as impls
    FastFakeTensorMode.views_unsafe = impls.get(_VIEW) is not None and impls.get(_VIEW) is impls.get(_UNSAFE_VIEW)
    return direct_dispatch(FastFakeTensorMode)(**kwargs)


def direct_dispatch(mode_class: type) -> type:
    """Return a subclass of the dispatch mode `mode_class` whose __torch_dispatch__ torch calls as it is, without the
    wrapper TorchDispatchMode's subclasses get to keep torch.compile out of it: for fake steps, where nothing is
    compiled and the wrapper costs ~5% of the step (every operator and every fake tensor's device query passes it)."""
    if mode_class not in _DIRECT:
        owner = next(c for c in mode_class.__mro__ if "__torch_dispatch__" in c.__dict__)  # (the class defining it)
        raw = owner.__dict__["__torch_dispatch__"]
        if owner._should_skip_dynamo() and not isinstance(raw, classmethod):  # (torch wrapped it there, as it
            raw = raw.__wrapped__  # wraps every dispatch mode's method but a classmethod: functools.wraps)
        _DIRECT[mode_class] = type(f"Direct{mode_class.__name__}", (mode_class,), {
            "__torch_dispatch__": raw, "__module__": mode_class.__module__, "__doc__": mode_class.__doc__,
            "_should_skip_dynamo": classmethod(lambda cls: False)})
    return _DIRECT[mode_class]
