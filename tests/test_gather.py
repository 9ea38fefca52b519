"""Gather family on CPU (interpreter): torch's gather, index_select and embedding shapes against
the float64 reference, out-of-range ids, strides, broadcast, integer tables, an epilogue."""
import pytest
import torch

import dnngraph as dg
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
