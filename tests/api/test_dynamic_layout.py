"""Reshape and concatenate over dynamic extents: a reshape that keeps each dynamic axis whole
(named by its dg.dynamic symbol in dim: [B, S, H*D] <-> [B, S, H, D], one or two dynamic axes,
size-1 axes merged away) and a concatenate beside a dynamic axis, each against g.reference in
float64 at the range's ends and odd sizes on poisoned outputs, through execute, as_function
(gradients too) and a shipped blob; forms no multiple of one symbol expresses (literal sizes,
S + 4, S + R) are refused at the op call with a typed error that says so, and add nothing.
Products of a symbol and constants (k * S): tests/api/test_dynamic_product.py."""
import json

import pytest
import torch

import dnngraph as dg
from dnngraph.tensor import dense_strides, stride_order
from helpers import TOLERANCE, rel_err

TOL = TOLERANCE[torch.float32]


def _at(handle, sizes: dict) -> list:
    return [sizes[d.name] if isinstance(d, dg.Dynamic) else d for d in handle.dynamic_dim]


def _poisoned_for(handle, sizes: dict) -> torch.Tensor:
    dims = _at(handle, sizes)
    strides = dense_strides(dims, stride_order(handle.dim, handle.stride))
    return torch.empty_strided(dims, strides).fill_(float("nan"))


def _run(g, inputs: dict, sizes: dict) -> dict:
    """Outputs of g at `sizes` (poisoned first), each checked against g.reference."""
    outputs = {t.name: _poisoned_for(t, sizes) for t in g.outputs()}
    g.execute({**inputs, **outputs})
    reference = g.reference(inputs)
    for name, value in outputs.items():
        assert list(value.shape) == list(reference[name].shape), name
        assert rel_err(value, reference[name]) < TOL, (name, sizes)
    return outputs


def _heads_graph():
    """x [2, S, 24] (stored S-major: a non-contiguous layout dense at every size) projected, split
    into 4 heads of 6 ([2, S, 4, 6]), softmax per head in [2, 4, S, 6], merged back to [2, S, 24];
    beside it x joined with relu(x) along the static feature axis."""
    seq = dg.dynamic("seq", 1, 12)
    g = dg.Graph(name="heads")
    x = g.tensor(name="x", dim=[2, seq, 24], stride=[24, 48, 1])
    w = g.tensor(name="w", dim=[24, 24])
    split = g.reshape(g.matmul(x, w), [2, seq, 4, 6])
    assert split.dynamic_dim == (2, seq, 4, 6)
    heads = g.softmax(g.transpose(split, [0, 2, 1, 3]), axis=-1)
    heads.set_output(True).set_name("heads")
    merged = g.reshape(g.transpose(heads, [0, 2, 1, 3]), [2, seq, 24])
    g.exp(merged).set_output(True).set_name("merged")
    joined = g.concatenate([x, g.relu(x), g.tensor(name="side", dim=[2, seq, 3])], axis=2)
    assert joined.dynamic_dim == (2, seq, 51)
    joined.set_output(True).set_name("joined")
    return g


def _heads_inputs(seq: int) -> dict:
    return {"x": torch.randn(seq, 2, 24).transpose(0, 1), "w": torch.randn(24, 24) / 5,
            "side": torch.randn(2, seq, 3)}


def test_split_and_merged_heads_and_a_concat_beside_run_every_size():
    g = _heads_graph().build()
    for seq in (1, 12, 7, 2, 7):
        _run(g, _heads_inputs(seq), {"seq": seq})
    assert g.plan.builds == 4  # 1 and 12 at the build, then 7 and 2; the second 7 is a lookup


def test_two_dynamic_axes_kept_whole_and_size_one_axes_merged_away():
    batch, seq = dg.dynamic("batch", 1, 3), dg.dynamic("seq", 2, 9)
    g = dg.Graph(name="two")
    x = g.tensor(name="x", dim=[batch, seq, 1, 12])
    y = g.reshape(g.sigmoid(x), [batch, seq, 3, 4])
    assert y.dynamic_dim == (batch, seq, 3, 4)
    y.set_output(True).set_name("y")
    flat = g.reshape(g.tensor(name="z", dim=[1, seq, 5]), [seq, 5])  # merged with a size-1 axis
    assert flat.dynamic_dim == (seq, 5)
    g.add(flat, g.tensor(name="bias", dim=[1, 5])).set_output(True).set_name("flat")
    # whole at every size, though not where it stood: [2, seq, 6] row-major as [seq, 12]
    g.neg(g.reshape(g.tensor(name="u", dim=[2, seq, 6]), [seq, 12])).set_output(True).set_name("moved")
    g.build()
    for b, s in ((1, 2), (3, 9), (2, 5)):
        sizes = {"batch": b, "seq": s}
        _run(g, {"x": torch.randn(b, s, 1, 12), "z": torch.randn(1, s, 5), "bias": torch.randn(1, 5),
                 "u": torch.randn(2, s, 6)}, sizes)


def test_sizes_outside_the_range_write_nothing():
    g = _heads_graph().build()
    inputs = _heads_inputs(13)
    outputs = {t.name: _poisoned_for(t, {"seq": 13}) for t in g.outputs()}
    with pytest.raises(dg.ExecutionError, match="outside the declared range"):
        g.execute({**inputs, **outputs})
    assert all(torch.isnan(value).all() for value in outputs.values())


def test_forms_no_symbol_expresses_are_refused_at_the_op():
    seq = dg.dynamic("seq", 1, 12)
    g = dg.Graph(name="refused")
    x = g.tensor(name="x", dim=[2, seq, 6])
    with pytest.raises(dg.UnsupportedError, match="constant multiple of a symbol"):
        g.reshape(x, [24, 6])  # 2 * seq merged, written as a literal (dg: [2 * seq, 6])
    with pytest.raises(dg.UnsupportedError, match="constant multiple of a symbol"):
        g.reshape(x, [2, 12, 6])  # the dynamic axis written as a literal
    with pytest.raises(dg.ValidationError, match="cannot reshape"):
        g.reshape(x, [seq, 6])  # half the elements at every size
    with pytest.raises(dg.ValidationError, match="no multiple of a dynamic axis"):
        g.reshape(x, [2, dg.dynamic("other", 1, 12), 6])
    rows = g.tensor(name="rows", dim=[2, dg.dynamic("rows", 1, 12), 6])
    with pytest.raises(dg.UnsupportedError, match="sum"):
        g.concatenate([x, rows], axis=1)  # seq + rows
    with pytest.raises(dg.UnsupportedError, match="sum"):
        g.concatenate([x, g.tensor(name="four", dim=[2, 4, 6])], axis=1)  # seq + 4
    assert [t.name for t in g.tensors] == ["x", "rows", "four"]  # refused calls added nothing


def test_reshape_symbols_survive_to_json_and_static_documents_read_as_before():
    g = _heads_graph()
    again = dg.Graph.from_json(g.to_json())
    assert again.tensor_by_name("merged").dynamic_dim[1] == dg.dynamic("seq", 1, 12)
    again.build()
    _run(again, _heads_inputs(5), {"seq": 5})
    static = dg.Graph(name="static")
    static.reshape(static.tensor(name="x", dim=[2, 6]), [3, 4]).set_output(True)
    (record,) = json.loads(static.to_json())["nodes"]
    assert record["attrs"] == {"dim": [3, 4]}


def test_as_function_runs_and_differentiates_each_size():
    seq = dg.dynamic("seq", 1, 12)
    g = dg.Graph(name="fn")
    x = g.tensor(name="x", dim=[2, seq, 24])
    w = g.tensor(name="w", dim=[24, 24])
    split = g.reshape(g.matmul(x, w), [2, seq, 4, 6])
    y = g.reshape(g.tanh(split), [2, seq, 24])
    g.concatenate([y, x], axis=2).set_output(True)
    fn = g.as_function()
    for n in (1, 9, 12):
        xt, wt = torch.randn(2, n, 24, requires_grad=True), (torch.randn(24, 24) / 5).requires_grad_()
        got = fn(xt, wt)
        assert got.shape == (2, n, 48)
        ref_x, ref_w = xt.detach().double().requires_grad_(), wt.detach().double().requires_grad_()
        expected = torch.cat([torch.tanh(ref_x @ ref_w), ref_x], dim=2)
        assert rel_err(got, expected) < TOL
        weights = torch.randn(2, n, 48)
        (got * weights).sum().backward()
        (expected * weights.double()).sum().backward()
        assert rel_err(xt.grad, ref_x.grad) < TOL and rel_err(wt.grad, ref_w.grad) < TOL


def test_a_blob_of_the_heads_graph_runs_its_sizes():
    g = _heads_graph().build(sizes=[{"seq": 5}])
    loaded = dg.Graph.deserialize(g.serialize())
    for seq in (1, 5, 12):
        _run(loaded, _heads_inputs(seq), {"seq": seq})
    assert loaded.plan.builds == 0


def test_torch_compile_dynamic_true_runs_head_reshapes_and_a_cat_along_the_length_in_dnngraph():
    """The torch backend converts a symbolic graph per shape (torch_backend's module doc): a
    reshape to heads and back and a cat along the symbolic length run in dnngraph, no op left
    to torch, one dynamo compile for every length."""
    from torch._dynamo.utils import counters
    from dnngraph import torch_backend

    def heads_then_cat(x, y):
        batch, length, _ = x.shape
        h = x.reshape(batch, length, 4, 6).transpose(1, 2).softmax(-1).transpose(1, 2).reshape(batch, length, 24)
        return torch.cat([h, y], dim=1).relu()

    torch._dynamo.reset()
    counters.clear()
    torch_backend.REPORTS.clear()
    compiled = torch.compile(heads_then_cat, backend="dnngraph", dynamic=True)
    for length in (3, 7, 10):
        x, y = torch.randn(2, length, 24), torch.randn(2, 5, 24)
        assert rel_err(compiled(x, y), heads_then_cat(x.double(), y.double())) < TOL, length
    assert counters["stats"]["unique_graphs"] == 1
    assert torch_backend.REPORTS and all(r.torch_ops == () and r.dnngraph_ops > 0 for r in torch_backend.REPORTS)


def test_integers_and_special_values_pass_through_exactly():
    """int32 values reshaped and joined beside a dynamic axis stay exact; NaN and inf in a float
    input come out where the reference has them."""
    seq = dg.dynamic("seq", 1, 9)
    g = dg.Graph(name="exact")
    ints = g.tensor(name="ints", dim=[seq, 6], data_type=dg.int32)
    g.concatenate([g.reshape(ints, [seq, 2, 3]), g.tensor(name="more", dim=[seq, 2, 3], data_type=dg.int32)],
                  axis=1).set_output(True).set_name("joined")
    floats = g.tensor(name="floats", dim=[seq, 4], data_type=dg.float32)
    g.neg(g.reshape(floats, [seq, 2, 2])).set_output(True).set_name("negated")
    g.build()
    for n in (1, 4, 9):
        values = torch.randn(n, 4)
        values[0, 0], values[-1, -1], values[0, 1] = float("nan"), float("inf"), float("-inf")
        inputs = {"ints": torch.randint(-2 ** 30, 2 ** 30, (n, 6), dtype=torch.int32),
                  "more": torch.randint(-2 ** 30, 2 ** 30, (n, 2, 3), dtype=torch.int32), "floats": values}
        outputs = {"joined": torch.full((n, 4, 3), -7, dtype=torch.int32),
                   "negated": torch.full((n, 2, 2), 123.0)}
        g.execute({**inputs, **outputs})
        reference = g.reference(inputs)
        assert torch.equal(outputs["joined"], reference["joined"]), n
        assert torch.allclose(outputs["negated"].double(), reference["negated"], rtol=0, atol=0, equal_nan=True), n
