"""The host path of Graph.as_function (what the torch.compile backend calls per partition): inputs
already in their declared layout pass without a copy, outputs are allocated in theirs, and the
plan checks a set of addresses once (execute_conformed), reading only the addresses afterwards.
The overlap check of a new binding set is one sweep, tested here against the pairwise rule on
contiguous ranges (tests/runtime/test_binding_overlap.py tests strided views)."""
import random

import pytest
import torch

import dnngraph as dg
import dnngraph.runtime.plan as plan_module
from dnngraph.runtime.plan import BindingSpec, _check_outputs_apart
from dnngraph.runtime.overlap import StridedBytes
from helpers import rel_err

GEN = torch.Generator().manual_seed(17)


def _pairwise_overlap(ranges):
    """The rule, pair by pair: an output may share no byte with any other binding (an empty
    binding has no bytes)."""
    for start, end, spec in ranges:
        if not spec.is_output or start == end:
            continue
        for other_start, other_end, other in ranges:
            if other is not spec and other_start < other_end and start < other_end and other_start < end:
                return True
    return False


def _spec(name, is_output):
    return BindingSpec(0, name, (1,), (1,), torch.float32, (), 4, is_output)


@pytest.mark.parametrize("seed", range(300))
def test_overlap_sweep_agrees_with_the_pairwise_rule(seed):
    rng = random.Random(seed)
    ranges = []
    for i in range(rng.randint(1, 9)):
        start = rng.randint(0, 60)
        ranges.append((start, start + rng.choice([0, 1, 4, 8, 16, 30]), _spec(f"t{i}", rng.random() < 0.4)))
    expected = _pairwise_overlap(ranges)
    bound = [(StridedBytes(start, ((end - start, 1),)), spec) for start, end, spec in ranges]  # contiguous bytes
    if expected:
        with pytest.raises(dg.ExecutionError, match="overlaps"):
            _check_outputs_apart(bound)
    else:
        _check_outputs_apart(bound)


def _function():
    """(x [7, 5] transposed-strided input, w [5]) -> relu(x * w) summed over rows, and x * w."""
    g = dg.Graph(name="fast_path")
    x = g.tensor(name="x", dim=[7, 5], stride=[1, 7])
    w = g.tensor(name="w", dim=[5])
    product = g.mul(x, w)
    total = g.reduction(g.relu(product), axes=[1], mode="sum").set_output(True).set_name("total")
    product.set_output(True).set_name("product")
    return g, g.as_function([x, w], [total, product])


def _check(fn, xt, wt):
    total, product = fn(xt, wt)
    expected = xt.double() * wt.double()
    assert rel_err(product, expected) < 1e-6
    assert rel_err(total, expected.relu().sum(1, keepdim=True).reshape(total.shape)) < 1e-6


def test_inputs_in_their_layout_pass_without_copies_and_addresses_are_checked_once(monkeypatch):
    g, fn = _function()
    xt = torch.randn(5, 7, generator=GEN).t()  # the declared strides (1, 7)
    wt = torch.randn(5, generator=GEN)
    seen = []
    real_execute = plan_module.Plan.execute_conformed
    monkeypatch.setattr(plan_module.Plan, "execute_conformed",
                        lambda self, token, keys, values, *device: (seen.append([v.data_ptr() for v in values]),
                                                                    real_execute(self, token, keys, values, *device))[1])
    prepared = []
    real_prepare = plan_module.Plan._prepare
    monkeypatch.setattr(plan_module.Plan, "_prepare",
                        lambda self, *a: (prepared.append(1), real_prepare(self, *a))[1])
    _check(fn, xt, wt)
    assert seen[-1][:2] == [xt.data_ptr(), wt.data_ptr()]  # no copies
    plan, runner = fn._plain[0].plan, fn._plain_runner
    values = [xt, wt] + [torch.empty_strided(dim, stride).fill_(float("nan")) for dim, stride, _ in runner.outputs]
    count = len(prepared)
    for _ in range(3):
        values[-1].fill_(float("nan"))
        plan.execute_conformed(runner.token, runner.keys, values)
        assert rel_err(values[-1], xt.double() * wt.double()) < 1e-6
    assert len(prepared) == count + 1, "a binding set seen before is checked again"
    values[-1] = torch.empty_strided(values[-1].shape, values[-1].stride())  # a new address: checked again
    plan.execute_conformed(runner.token, runner.keys, values)
    assert len(prepared) == count + 2


def test_inputs_in_another_layout_are_copied_and_parameters_take_the_checked_path():
    _, fn = _function()
    xt = torch.randn(7, 5, generator=GEN)  # contiguous: strides (5, 1), not the declared (1, 7)
    wt = torch.nn.Parameter(torch.randn(5, generator=GEN), requires_grad=False)
    _check(fn, xt, wt)
    _check(fn, xt[:, None, :].expand(7, 3, 5)[:, 1], wt)  # a strided view


def test_bad_inputs_are_refused_before_anything_runs():
    _, fn = _function()
    with pytest.raises(dg.ExecutionError, match="shape"):
        fn(torch.randn(5, 7, generator=GEN), torch.randn(5, generator=GEN))
    with pytest.raises(dg.ExecutionError, match="float32|dtype|expects"):
        fn(torch.randn(5, 7, generator=GEN).t().double(), torch.randn(5, generator=GEN))


def test_execute_conformed_checks_a_new_address_set_in_full():
    """An output bound over an input's bytes is refused and nothing is written."""
    g, _ = _function()
    g.build()
    x, w = g.tensor_by_name("x"), g.tensor_by_name("w")
    total, product = g.tensor_by_name("total"), g.tensor_by_name("product")
    backing = torch.randn(5, 7, generator=GEN)
    xt = backing.t()
    wt = torch.randn(5, generator=GEN)
    alias = backing.reshape(-1)[:35].view(5, 7).t()  # product over x's bytes
    before = backing.clone()
    keys = (x, w, total, product)
    with pytest.raises(dg.ExecutionError, match="overlaps"):
        g.plan.execute_conformed(object(), keys, [xt, wt, torch.empty(7, 1), alias])
    assert torch.equal(backing, before)
