"""Gather family on CPU (interpreter): torch's gather, index_select and embedding shapes against
the float64 reference, out-of-range ids, strides, broadcast, integer tables, an epilogue."""
import pytest
import torch

import dnngraph as dg
from dnngraph.ops.gather import ScatterAddAttrs
from helpers import check, run

IO_TYPES = {torch.float32: dg.float32, torch.float16: dg.float16, torch.bfloat16: dg.bfloat16}


def gather_graph(table, ids, axis, io=dg.float32):
    g = dg.Graph(io_data_type=io)
    x, index = g.tensor_like(table, "x"), g.tensor_like(ids, "index")
    y = g.gather(x, index, axis).set_output(True)
    return g, x, index, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_gather_along_every_axis_is_torchs(axis, dtype):
    """torch.gather's form (index of y's dims, smaller than x off the axis is sliced by the
    caller; here equal), odd sizes, int32 and int64 ids."""
    torch.manual_seed(axis)
    table = (torch.randn(5, 7, 3) + 0.1).to(dtype)
    shape = list(table.shape)
    shape[axis] = 9
    ids = torch.randint(0, table.shape[axis], shape, dtype=torch.int32 if axis == 1 else torch.int64)
    g, x, index, y = gather_graph(table, ids, axis, IO_TYPES[dtype])
    out = check(g, {x: table, index: ids}, dtype)[y.name]
    assert torch.equal(out, torch.gather(table, axis, ids.long()))


def test_index_select_and_embedding_shapes_broadcast_the_index():
    torch.manual_seed(0)
    table = torch.randn(11, 6)
    ids = torch.randint(0, 11, (13, 1))  # embedding: one id per row, every column
    g, x, index, y = gather_graph(table, ids, 0)
    assert y.dim == (13, 6)
    assert torch.equal(check(g, {x: table, index: ids})[y.name], table[ids[:, 0]])
    ids = torch.randint(0, 6, (1, 4))  # index_select on axis 1
    g, x, index, y = gather_graph(table, ids, 1)
    assert torch.equal(check(g, {x: table, index: ids})[y.name], table.index_select(1, ids[0]))


def test_strided_tables_ids_and_size_one_axes():
    torch.manual_seed(1)
    table = torch.randn(9, 4, 10).transpose(0, 2)[:, 1:, ::2]  # [10, 3, 5], no axis contiguous
    ids = torch.randint(0, 10, (4, 3, 1)).expand(4, 3, 5)  # broadcast (stride-0) ids
    g, x, index, y = gather_graph(table, ids, 0)
    assert torch.equal(check(g, {x: table, index: ids})[y.name], torch.gather(table, 0, ids))
    single = torch.randn(1, 1, 5)  # a table of one row: every valid id is 0
    ids = torch.zeros(3, 1, 5, dtype=torch.int64)
    g, x, index, y = gather_graph(single, ids, 0)
    assert torch.equal(check(g, {x: single, index: ids})[y.name], single.expand(3, 1, 5))


def test_out_of_range_ids_read_nothing_and_give_nan_or_zero():
    """torch raises on such ids; the kernel cannot, so it never reads outside the table and
    says so in the value: NaN for floats, 0 for integers, False for bools (the reference too)."""
    ids = torch.tensor([[0], [-1], [5], [2**40], [4], [-(2**62)]])
    for table, missing in [(torch.randn(5, 3), float("nan")), (torch.arange(15, dtype=torch.int32).view(5, 3), 0),
                           (torch.rand(5, 3) > 0.5, False)]:
        g, x, index, y = gather_graph(table, ids, 0)
        out = run(g, {x: table, index: ids})[y.name]
        ref = g.reference({x: table, index: ids})[y.name]
        assert out.dtype == table.dtype
        for row, picked in zip(ids[:, 0].tolist(), out):
            want = table[row] if 0 <= row < 5 else torch.full((3,), missing, dtype=table.dtype)
            torch.testing.assert_close(picked, want, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(out, ref.to(out.dtype), equal_nan=True, rtol=0, atol=0)


def test_nan_and_inf_in_the_table_pass_through():
    table = torch.tensor([[float("nan"), 1.0], [float("inf"), -float("inf")]])
    ids = torch.tensor([[1], [0], [1]])
    g, x, index, y = gather_graph(table, ids, 0)
    torch.testing.assert_close(run(g, {x: table, index: ids})[y.name], table[ids[:, 0]], equal_nan=True)


def test_epilogue_scale_and_position_add_ride_the_gather_kernel():
    """An embedding scaled and added to position embeddings: one kernel, its source loads the
    ids once and the table by them."""
    torch.manual_seed(2)
    g = dg.Graph(io_data_type=dg.float16)
    table, positions = g.tensor(name="table", dim=[17, 8]), g.tensor(name="positions", dim=[5, 8])
    ids = g.tensor(name="ids", dim=[5, 1], data_type=dg.int32)
    y = g.add(g.mul(g.gather(table, ids, 0), 2.5), positions).set_output(True)
    inputs = {table: torch.randn(17, 8).half(), positions: torch.randn(5, 8).half(),
              ids: torch.randint(0, 17, (5, 1), dtype=torch.int32)}
    check(g, inputs, torch.float16)
    assert len(g.plan.launches) == 1
    assert g.plan.launches[0].group.kind == "gather"


def test_gathered_value_read_elsewhere_is_stored_once_and_survives_json():
    torch.manual_seed(3)
    g = dg.Graph()
    table = g.tensor(name="idx_0", dim=[6, 4])  # a name that looks like a kernel variable
    ids = g.tensor(name="ids", dim=[3, 4], data_type=dg.int64)
    picked = g.gather(table, ids, 0).set_output(True)
    g.exp(picked).set_output(True)
    g.reduction(picked, "sum", [1]).set_output(True)
    inputs = {"idx_0": torch.randn(6, 4), "ids": torch.randint(0, 6, (3, 4))}
    check(g, inputs)
    again = dg.Graph.from_json(g.to_json())
    check(again, inputs)


def test_bad_gathers_raise_at_the_op_call_and_change_nothing():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[4, 3])
    float_ids = g.tensor(name="f", dim=[2, 3])
    ids = g.tensor(name="i", dim=[2, 3], data_type=dg.int64)
    flat_ids = g.tensor(name="flat", dim=[6], data_type=dg.int64)
    wide = g.tensor(name="wide", dim=[2, 5], data_type=dg.int64)
    cases = [(lambda: g.gather(x, float_ids, 0), "int32 or int64"), (lambda: g.gather(x, flat_ids, 0), "one rank"),
             (lambda: g.gather(x, wide, 0), "broadcast"), (lambda: g.gather(x, ids, 2), "axis"),
             (lambda: g.gather(x, ids, 0.0), "axis")]
    for call, message in cases:
        with pytest.raises(dg.ValidationError, match=message):
            call()
    assert len(g.nodes) == 0


# --- scatter_add (the gather's gradient) ---------------------------------------------------------
def scatter_graph(src, ids, axis, size):
    g = dg.Graph()
    s, index = g.tensor_like(src, "src"), g.tensor_like(ids, "index")
    y = g.scatter_add(s, index, axis, size).set_output(True)
    return g, s, index, y


@pytest.mark.parametrize("axis", [0, 1])
def test_scatter_add_is_torchs_with_repeated_and_out_of_range_ids(axis):
    """Repeated ids sum (in id order: the same bits on every run), ids outside y add nothing."""
    torch.manual_seed(4)
    src = torch.randn(9, 5) if axis == 0 else torch.randn(5, 9)
    ids = torch.randint(-2, 8, src.shape)
    g, s, index, y = scatter_graph(src, ids, axis, 6)
    out = check(g, {s: src, index: ids})[y.name]
    valid = (ids >= 0) & (ids < 6)
    want = torch.zeros(6, 5) if axis == 0 else torch.zeros(5, 6)
    want.scatter_add_(axis, ids.clamp(0, 5), torch.where(valid, src, 0.0))
    torch.testing.assert_close(out, want)
    assert torch.equal(run(g, {s: src, index: ids})[y.name], out)


def test_scatter_add_of_broadcast_ids_and_strided_src_with_nan():
    """An embedding's gradient: ids [N, 1] broadcast over the row; a transposed src holding NaN
    and inf, which reach only the rows their ids name."""
    src = torch.randn(7, 13).t()  # [13, 7], transposed
    src[2, 3], src[5, 0] = float("nan"), float("inf")
    ids = torch.tensor([4, 0, 1, 4, 4, 9, 0, 3, 2, 1, 0, 4, 10]).view(13, 1)
    g, s, index, y = scatter_graph(src, ids, 0, 11)
    out = run(g, {s: src, index: ids})[y.name]
    want = torch.zeros(11, 7).index_add_(0, ids[:, 0], src)
    torch.testing.assert_close(out, want, equal_nan=True)
    torch.testing.assert_close(out, g.reference({s: src, index: ids})[y.name].float(), equal_nan=True)


def test_gather_differentiates_through_scatter_add_and_back():
    """as_function's gradient of a gather is the scatter-add (and a scatter-add's a gather)."""
    torch.manual_seed(5)
    g = dg.Graph()
    x, ids = g.tensor(name="x", dim=[6, 4]), g.tensor(name="ids", dim=[9, 1], data_type=dg.int64)
    y = g.mul(g.gather(x, ids, 0), 3.0).set_output(True)
    fn = g.as_function([x, ids], [y])
    x_t, ids_t = torch.randn(6, 4, requires_grad=True), torch.randint(0, 6, (9, 1))
    dy = torch.randn(9, 4)
    (got,) = torch.autograd.grad(fn(x_t, ids_t), x_t, dy)
    leaf = x_t.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(torch.nn.functional.embedding(ids_t[:, 0], leaf) * 3.0, leaf, dy)
    torch.testing.assert_close(got, want)


def test_bad_scatters_raise_at_the_op_call():
    g = dg.Graph()
    src = g.tensor(name="src", dim=[4, 3])
    ids = g.tensor(name="ids", dim=[5, 3], data_type=dg.int64)
    with pytest.raises(dg.ValidationError, match="extent"):
        g.scatter_add(src, ids, 0, 6)
    with pytest.raises(dg.ValidationError, match="size"):
        ScatterAddAttrs(0, 0)
    assert len(g.nodes) == 0


@pytest.mark.gpu
def test_gpu_bf16_embedding_gather_and_its_scatter_add():
    """A bf16 embedding lookup with a fused scale on the GPU, out-of-range ids included, and
    its gradient; the scatter's sum is the same on every run."""
    torch.manual_seed(6)
    table = torch.randn(1000, 96, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(-3, 1003, (257, 1), device="cuda")
    g = dg.Graph(io_data_type=dg.bfloat16)
    x, index = g.tensor_like(table, "x"), g.tensor_like(ids, "index")
    y = g.mul(g.gather(x, index, 0), 2.0).set_output(True)
    check(g, {x: table, index: ids}, torch.bfloat16, device="cuda")
    dy_t = torch.randn(257, 96, device="cuda")
    g = dg.Graph()
    dy, index = g.tensor_like(dy_t, "dy"), g.tensor_like(ids, "index")
    dx = g.scatter_add(dy, index, 0, 1000).set_output(True)
    first = check(g, {dy: dy_t, index: ids}, device="cuda")[dx.name]
    assert torch.equal(first, run(g, {dy: dy_t, index: ids}, device="cuda")[dx.name])
