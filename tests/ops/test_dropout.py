"""Dropout on CPU (interpreter): the mask equals ops/random.py bit for bit, fusion, backward."""
import math

import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.codegen.emitter import ExpressionEmitter
from dnngraph.fusion import partition
from dnngraph.ops.base import lookup
from dnngraph.ops.dropout import DropoutAttrs
from dnngraph.ops.random import keep_mask
from helpers import check, run

IO_TYPES = {torch.float32: dg.float32, torch.float16: dg.float16, torch.bfloat16: dg.bfloat16}

# (seed, offset): seeds past 2^32 and 2^63 use the key's high word; offsets near 2^31 force the
# int64 counter, near 2^32 the counter's high word changes inside the tensor (1961 elements)
SEEDS_AND_OFFSETS = [(0, 0), (12345, 7), (2**32 + 7, 2**31 - 500), (2**40 + 3, 2**32 - 1000),
                     (2**64 - 3, 2**40 + 11), (2**63 + 5, 0)]


def dropout_graph(x_t, p, seed, offset, dtype=torch.float32):
    """Graph y, mask = dropout(x); returns (graph, x handle, y, mask)."""
    g = dg.Graph(io_data_type=IO_TYPES[dtype])
    x = g.tensor_like(x_t, name="x")
    y, mask = g.dropout(x, p=p, seed=seed, offset=offset, return_mask=True)
    y.set_output(True)
    mask.set_output(True)
    return g, x, y, mask


def assert_mask_exact(mask_out, seed, offset, p):
    expected = keep_mask(seed, offset, mask_out.shape, p, device=mask_out.device)
    assert mask_out.dtype == torch.bool
    assert torch.equal(mask_out, expected), f"{(mask_out != expected).sum().item()} mask bits differ"


@pytest.mark.parametrize("seed,offset", SEEDS_AND_OFFSETS)
def test_mask_matches_reference_bit_for_bit(seed, offset):
    x_t = torch.randn(37, 53)
    g, x, y, mask = dropout_graph(x_t, 0.3, seed, offset)
    outputs = check(g, {x: x_t})
    assert_mask_exact(outputs[mask.name], seed, offset, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_values_against_float64_reference(dtype):
    x_t = torch.randn(29, 131).to(dtype)
    g, x, y, mask = dropout_graph(x_t, 0.2, 99, 5, dtype)
    outputs = check(g, {x: x_t}, dtype)
    assert outputs[y.name].dtype == dtype
    assert_mask_exact(outputs[mask.name], 99, 5, 0.2)


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "sliced", "permuted3d", "one_dim"])
def test_counter_follows_the_logical_index_for_any_layout(layout):
    if layout == "transposed":
        x_t = torch.randn(41, 29).t()
    elif layout == "channels_last":
        x_t = torch.randn(3, 6, 7, 5).contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        x_t = torch.randn(31, 50)[3:28:2, 1:40]
    elif layout == "permuted3d":
        x_t = torch.randn(7, 3, 5).permute(1, 2, 0)
    else:
        x_t = torch.randn(1009)
    g, x, y, mask = dropout_graph(x_t, 0.4, 2**33 + 1, 77)
    outputs = check(g, {x: x_t})
    assert_mask_exact(outputs[mask.name], 2**33 + 1, 77, 0.4)


def test_p_zero_keeps_everything_exactly():
    x_t = torch.randn(17, 23)
    g, x, y, mask = dropout_graph(x_t, 0.0, 3, 0)
    outputs = run(g, {x: x_t})
    assert torch.equal(outputs[y.name], x_t)
    assert outputs[mask.name].all()


def test_p_near_one_keeps_almost_nothing():
    x_t = torch.randn(64, 97)
    g, x, y, mask = dropout_graph(x_t, 0.999, 11, 2**35)
    outputs = check(g, {x: x_t})
    assert_mask_exact(outputs[mask.name], 11, 2**35, 0.999)
    assert outputs[mask.name].sum().item() < 40  # about 6 of 6208 expected


def test_keep_fraction_is_close_to_one_minus_p():
    p, shape = 0.3, (128, 1024)
    g = dg.Graph()
    x = g.tensor(name="x", dim=list(shape))
    g.dropout(x, p=p, seed=2024, offset=0).set_output(True)
    out = next(iter(run(g, {x: torch.rand(shape) + 0.5}).values()))
    kept = (out != 0).double().mean().item()
    sigma = math.sqrt(p * (1 - p) / out.numel())  # 0.0013 for 131072 draws
    assert abs(kept - (1 - p)) < 5 * sigma


def test_mask_is_stored_only_when_asked_for():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[9, 15])
    y = g.dropout(x, p=0.5, seed=1, offset=0).set_output(True)
    g.build()
    (group,) = g.plan.groups
    assert [t.name for t in group.outputs] == [y.name]
    check(g, {x: torch.randn(9, 15)})


def test_bias_dropout_residual_add_is_one_kernel():
    g = dg.Graph()
    x, r = g.tensor(name="x", dim=[33, 65]), g.tensor(name="r", dim=[33, 65])
    b = g.tensor(name="b", dim=[1, 65])
    y, mask = g.dropout(g.add(x, b), p=0.25, seed=2**36 + 9, offset=1000, return_mask=True)
    out = g.add(y, r).set_output(True)
    mask.set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    inputs = {x: torch.randn(33, 65), b: torch.randn(1, 65), r: torch.randn(33, 65)}
    outputs = check(g, inputs)
    assert_mask_exact(outputs[mask.name], 2**36 + 9, 1000, 0.25)
    assert out.name in outputs


def test_two_dropouts_with_their_own_offsets_share_a_kernel():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[19, 21])
    first, first_mask = g.dropout(x, p=0.5, seed=5, offset=0, return_mask=True)
    second, second_mask = g.dropout(x, p=0.1, seed=6, offset=19 * 21, return_mask=True)
    g.mul(first, second).set_output(True)
    first_mask.set_output(True)
    second_mask.set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    outputs = check(g, {x: torch.randn(19, 21)})
    assert_mask_exact(outputs[first_mask.name], 5, 0, 0.5)
    assert_mask_exact(outputs[second_mask.name], 6, 19 * 21, 0.1)


def test_anchors_never_absorb_dropout():
    g = dg.Graph()
    a, w = g.tensor(name="a", dim=[16, 8]), g.tensor(name="w", dim=[8, 32])
    r = g.tensor(name="r", dim=[16, 32])
    g.add(g.dropout(g.matmul(a, w), p=0.1, seed=1), r).set_output(True)
    g.softmax(g.dropout(r, p=0.1, seed=2)).set_output(True)
    kinds = sorted((group.kind, [n.op for n in group.nodes]) for group in partition(g))
    # the two pointwise groups read r: siblings, one kernel (each dropout keeps its own seed)
    assert kinds == [("matmul", ["matmul"]), ("pointwise", ["dropout", "dropout", "add"]), ("softmax", ["softmax"])]


def test_dropout_result_is_not_broadcast_inside_its_group():
    # the [1, 16] dropout broadcast over [8, 16] would see the wrong counters: separate kernels
    g = dg.Graph()
    x, b = g.tensor(name="x", dim=[8, 16]), g.tensor(name="b", dim=[1, 16])
    small, mask = g.dropout(b, p=0.5, seed=3, offset=4, return_mask=True)
    g.add(x, small).set_output(True)
    mask.set_output(True)
    g.build()
    assert len(g.plan.launches) == 2
    outputs = check(g, {x: torch.randn(8, 16), b: torch.randn(1, 16)})
    assert_mask_exact(outputs[mask.name], 3, 4, 0.5)


def test_dropout_of_dy_is_the_autograd_gradient():
    p, seed, offset, shape = 0.35, 2**45 + 17, 2**33 + 5, (23, 47)
    x64 = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    dy_t = torch.randn(shape)
    (y64, _) = lookup("dropout").reference([x64, None, None], DropoutAttrs(p, seed, offset))
    (expected,) = torch.autograd.grad(y64, x64, dy_t.double())
    g = dg.Graph()
    dy = g.tensor(name="dy", dim=list(shape))
    dx = g.dropout(dy, p=p, seed=seed, offset=offset).set_output(True)
    out = run(g, {dy: dy_t})[dx.name].double()
    assert torch.equal(out == 0, expected == 0)
    assert (out - expected).norm() / expected.norm() < 2e-7


def test_reproducible_and_offset_changes_the_mask():
    x_t = torch.randn(31, 37)
    g, x, y, mask = dropout_graph(x_t, 0.5, 8, 100)
    first, second = run(g, {x: x_t}), run(g, {x: x_t})
    assert torch.equal(first[y.name], second[y.name]) and torch.equal(first[mask.name], second[mask.name])
    g_moved, x_moved, _, mask_moved = dropout_graph(x_t, 0.5, 8, 101)
    moved = run(g_moved, {x_moved: x_t})
    assert not torch.equal(first[mask.name], moved[mask_moved.name])
    # the counter of element i + 1 at offset 100 is that of element i at offset 101
    assert torch.equal(first[mask.name].flatten()[1:], moved[mask_moved.name].flatten()[:-1])


def test_seed_and_offset_are_runtime_arguments():
    x_t = torch.randn(5, 7)
    graphs = [dropout_graph(x_t, 0.5, seed, offset)[0] for seed, offset in ((1, 2), (2**50, 3))]
    for g in graphs:
        g.build()
    paths = [g.plan.launches[0].source_path for g in graphs]
    assert paths[0] == paths[1], "a new seed or offset must not change the kernel source"


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_p_outside_zero_one_is_rejected_at_the_call(p):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 4])
    with pytest.raises(dg.ValidationError, match="dropout"):
        g.dropout(x, p=p, seed=1)
    assert len(g.nodes) == 0


def test_emitter_without_a_counter_refuses_dropout():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 4])
    g.dropout(x, p=0.5, seed=1)
    emitter = ExpressionEmitter("tl.float32")
    emitter.bind(x.uid, "x", "f")
    with pytest.raises(dg.UnsupportedError, match="logical"):
        emitter.emit(g.nodes[0])


@pytest.mark.gpu
@pytest.mark.parametrize("seed,offset", [(2**40 + 3, 2**33 + 1), (7, 0)])
def test_bf16_large_on_cuda(seed, offset):
    x_t = torch.randn(4097, 8191, device="cuda").to(torch.bfloat16)
    g, x, y, mask = dropout_graph(x_t, 0.1, seed, offset, torch.bfloat16)
    outputs = check(g, {x: x_t}, torch.bfloat16, device="cuda")
    assert_mask_exact(outputs[mask.name], seed, offset, 0.1)


@pytest.mark.gpu
def test_bf16_dropout_residual_on_cuda_is_one_kernel():
    g = dg.Graph(io_data_type=dg.bfloat16)
    x, r = g.tensor(name="x", dim=[4097, 8191]), g.tensor(name="r", dim=[4097, 8191])
    g.add(g.dropout(x, p=0.1, seed=2**63 + 1, offset=2**31), r).set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    inputs = {t: torch.randn(4097, 8191, device="cuda").to(torch.bfloat16) for t in (x, r)}
    check(g, inputs, torch.bfloat16, device="cuda")


@pytest.mark.parametrize("seed_is_tensor,offset_is_tensor", [(True, True), (True, False), (False, True)])
def test_seed_and_offset_as_int64_tensors_serve_every_step(seed_is_tensor, offset_is_tensor):
    """One built graph, new (seed, offset) per execute: the mask is the reference's Philox mask
    for each; a seed tensor's int64 bits are the unsigned seed (-5 is 2^64 - 5)."""
    g = dg.Graph()
    x = g.tensor(name="x", dim=[19, 37])
    seed = g.tensor(name="seed", dim=[1], data_type=dg.int64) if seed_is_tensor else 2**45 + 3
    offset = g.tensor(name="offset", dim=[1, 1], data_type=dg.int64) if offset_is_tensor else 77
    y, mask = g.dropout(g.mul(x, 2.0), 0.3, seed, offset, return_mask=True)
    y.set_output(True)
    mask.set_output(True)
    g.build()
    assert len(g.plan.launches) == 1
    for seed_value, offset_value in ((-5, 2**33 + 1), (12345, 0)):
        inputs = {"x": torch.randn(19, 37)}
        if seed_is_tensor:
            inputs["seed"] = torch.tensor([seed_value], dtype=torch.int64)
        if offset_is_tensor:
            inputs["offset"] = torch.tensor([[offset_value]], dtype=torch.int64)
        outputs = check(g, inputs)
        assert_mask_exact(outputs[mask.name], seed_value % 2**64 if seed_is_tensor else 2**45 + 3,
                          offset_value if offset_is_tensor else 77, 0.3)


@pytest.mark.parametrize("bad", ["int32 seed", "two elements", "float offset"])
def test_seed_tensors_are_int64_with_one_element(bad):
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 4])
    dims = {"int32 seed": ([1], dg.int32), "two elements": ([2], dg.int64), "float offset": ([1], dg.float32)}[bad]
    t = g.tensor(name="t", dim=dims[0], data_type=dims[1])
    with pytest.raises(dg.ValidationError, match="int64 with one element"):
        if bad == "float offset":
            g.dropout(x, 0.1, 3, t)
        else:
            g.dropout(x, 0.1, t, 0)
