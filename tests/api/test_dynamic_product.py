"""Dynamic extents that are a constant multiple of one symbol (`2 * seq`): the reshapes a
transformer block does with a dynamic sequence length ([B, seq, H] -> [B * seq, H] for a matmul,
and back) keep the axis dynamic. Each graph is built once and run at the range's min, an odd size
and its max on poisoned outputs against g.reference in float64 (and torch in float64); products
through reductions, softmax, transpose, slice and concatenate, JSON and a shipped blob,
as_function, and a batched attention block (rows merged for its matmuls, planned for the H200 at
one compile per bucket); what no multiple of one symbol expresses is refused at the op call with a typed
error and adds nothing; sizes out of range, or an output axis no multiple of its coefficient,
write nothing."""
import json

import pytest
import torch

import dnngraph as dg
from dnngraph.ops.base import OutputSpec
from dnngraph.symbolic import Multiple, propagate
from dnngraph.tensor import dense_strides, stride_order
from helpers import TOLERANCE, rel_err

TOL = TOLERANCE[torch.float32]
SEQ = dg.dynamic("seq", 1, 37)
SIZES = (1, 19, 37)  # the min, an odd size, the max


def _extent(entry, sizes: dict):
    if isinstance(entry, (dg.Dynamic, Multiple)):
        return entry.extent(sizes[entry.symbol.name])
    return entry


def _dims_at(handle, sizes: dict) -> list:
    return [_extent(d, sizes) for d in handle.dynamic_dim]


def _poisoned_for(handle, sizes: dict) -> torch.Tensor:
    """NaN memory for graph tensor `handle` at `sizes`, dense in its axis order."""
    dims = _dims_at(handle, sizes)
    strides = dense_strides(dims, stride_order(handle.dim, handle.stride))
    return torch.empty_strided(dims, strides).fill_(float("nan"))


def _graph(name="block"):
    return dg.Graph(name=name, io_data_type=dg.float32, intermediate_data_type=dg.float32,
                    compute_data_type=dg.float32)


def _block():
    """x[2, seq, 64] -> [2 * seq, 64] @ w[64, 48] -> [2, seq, 48] -> gelu; w stored transposed."""
    g = _graph()
    x = g.tensor(name="x", dim=[2, SEQ, 64])
    w = g.tensor(name="w", dim=[64, 48], stride=[1, 64])
    rows = g.reshape(x, [2 * SEQ, 64])
    y = g.gelu(g.reshape(g.matmul(rows, w), [2, SEQ, 48]))
    y.set_output(True)
    return g, x, w, rows, y


def _block_inputs(seq: int) -> tuple:
    return torch.randn(2, seq, 64), torch.randn(48, 64).t()  # w non-contiguous, as declared


def test_block_with_a_merged_and_split_sequence_axis_runs_every_size():
    g, x, w, rows, y = _block()
    assert rows.dynamic_dim == (2 * SEQ, 64) and isinstance(rows.dynamic_dim[0], Multiple)
    assert y.dynamic_dim == (2, SEQ, 48)
    g.build()
    for seq in SIZES:
        xt, wt = _block_inputs(seq)
        out = _poisoned_for(y, {"seq": seq})
        g.execute({x: xt, w: wt, y: out})
        expected = torch.nn.functional.gelu(xt.double().reshape(2 * seq, 64) @ wt.double()).reshape(2, seq, 48)
        assert rel_err(out, expected) < TOL, seq
        assert rel_err(out, g.reference({x: xt, w: wt})[y.name]) < TOL, seq


def test_an_output_of_a_product_axis_gives_the_size_and_is_checked():
    g = _graph("rows_out")
    x = g.tensor(name="x", dim=[3, SEQ, 8], stride=None)
    w = g.tensor(name="w", dim=[8, 5])
    y = g.matmul(g.reshape(x, [3 * SEQ, 8]), w).set_output(True)
    assert y.dynamic_dim == (3 * SEQ, 5)
    g.build()
    for seq in (1, 7, 37):
        xt, wt = torch.randn(3, seq, 8), torch.randn(8, 5)
        out = _poisoned_for(y, {"seq": seq})
        assert out.shape == (3 * seq, 5)
        g.execute({x: xt, w: wt, y: out})
        assert rel_err(out, xt.double().reshape(3 * seq, 8) @ wt.double()) < TOL
    xt = torch.randn(3, 5, 8)
    for rows in (14, 16):  # no multiple of 3
        out = torch.full((rows, 5), float("nan"))
        with pytest.raises(dg.ExecutionError, match="seq|3 times"):
            g.execute({x: xt, w: torch.randn(8, 5), y: out})
        assert torch.isnan(out).all()
    out = torch.full((18, 5), float("nan"))  # 3 * 6: seq 6 here, 5 in x
    with pytest.raises(dg.ExecutionError, match="must agree"):
        g.execute({x: xt, w: torch.randn(8, 5), y: out})
    assert torch.isnan(out).all()


def test_sizes_out_of_range_write_nothing():
    g, x, w, _, y = _block()
    g.build()
    for seq in (38, 0):
        xt, wt = torch.randn(2, seq, 64), torch.randn(48, 64).t()
        out = torch.full((2, seq, 48), float("nan"))
        with pytest.raises(dg.ExecutionError, match="outside the declared range"):
            g.execute({x: xt, w: wt, y: out})
        assert torch.isnan(out).all()
    with pytest.raises(dg.ValidationError, match="seq"):
        g.specialised({"seq": 38})


def _rows_graph(make):
    g = _graph("rows")
    x = g.tensor(name="x", dim=[3, SEQ, 5], stride=dense_strides([3, 37, 5], (1, 0, 2)))  # seq outermost
    y = make(g, g.reshape(x, [3 * SEQ, 5]))
    y.set_output(True)
    return g, x, y


@pytest.mark.parametrize("make, expected", [
    (lambda g, r: g.softmax(r, axis=0), (3 * SEQ, 5)),                    # along the product axis
    (lambda g, r: g.softmax(r, axis=1, log=True), (3 * SEQ, 5)),           # rows of a product count
    (lambda g, r: g.reduction(r, "sum", axes=[0]), (1, 5)),                # the product axis reduced
    (lambda g, r: g.reduction(r, "max", axes=[1]), (3 * SEQ, 1)),          # a product axis kept
    (lambda g, r: g.reduction(g.exp(r), "mean", axes=[0, 1]), (1, 1)),
], ids=["softmax_along", "log_softmax_rows", "sum_over", "max_kept", "mean_all"])
def test_a_product_axis_in_reductions_and_softmax(make, expected):
    g, x, y = _rows_graph(make)
    assert y.dynamic_dim == expected
    g.build()
    for seq in SIZES:
        xt = torch.randn(seq, 3, 5).permute(1, 0, 2)  # the declared layout: seq outermost
        out = _poisoned_for(y, {"seq": seq})
        g.execute({x: xt, y: out})
        assert rel_err(out, g.reference({x: xt})[y.name]) < TOL, seq


def test_json_round_trip_of_a_product_axis_and_a_shipped_blob():
    g, x, w, rows, y = _block()
    text = g.to_json()
    reshapes = [n for n in json.loads(text)["nodes"] if n["op"] == "reshape"]
    assert [n["attrs"]["from_input"] for n in reshapes] == [[[0, 1, 2, 1]], [[1, 0, 1, 2]]]
    loaded = dg.Graph.from_json(text)
    assert loaded.to_json() == text
    assert loaded.tensor_by_name(rows.name).dynamic_dim == (2 * SEQ, 64)
    assert loaded.tensor_by_name(y.name).dynamic_dim == (2, SEQ, 48)
    g.build()
    shipped = dg.Graph.deserialize(g.serialize())
    for graph in (loaded.build(), shipped):
        lx, lw, ly = (graph.tensor_by_name(t.name) for t in (x, w, y))
        for seq in (1, 23):
            xt, wt = _block_inputs(seq)
            out = _poisoned_for(ly, {"seq": seq})
            graph.execute({lx: xt, lw: wt, ly: out})
            assert rel_err(out, g.reference({x: xt, w: wt})[y.name]) < TOL, seq
    document = json.loads(text)
    document["nodes"][0]["attrs"]["from_input"] = [[0, 1, 0, 1]]  # a multiplier of 0
    with pytest.raises(dg.SerializationError, match="from_input"):
        dg.Graph.from_json(json.dumps(document))


def test_as_function_sizes_a_product_output_from_its_inputs():
    g = _graph("fn")
    x = g.tensor(name="x", dim=[2, SEQ, 6])
    w = g.tensor(name="w", dim=[6, 4])
    y = g.tanh(g.matmul(g.reshape(x, [2 * SEQ, 6]), w)).set_output(True)
    fn = g.as_function()
    for seq in (3, 37, 3):
        xt, wt = torch.randn(2, seq, 6), torch.randn(6, 4)
        got = fn(xt, wt)
        assert got.shape == (2 * seq, 4)
        assert rel_err(got, torch.tanh(xt.double().reshape(2 * seq, 6) @ wt.double())) < TOL
    assert y.dynamic_dim[0] == 2 * SEQ
    for seq in (1, 11):  # differentiable at each size: the gradients of x [2, seq, 6] and w
        xt, wt = torch.randn(2, seq, 6, requires_grad=True), torch.randn(6, 4, requires_grad=True)
        fn(xt, wt).sum().backward()
        ref_x, ref_w = (t.detach().double().requires_grad_() for t in (xt, wt))
        torch.tanh(ref_x.reshape(2 * seq, 6) @ ref_w).sum().backward()
        assert rel_err(xt.grad, ref_x.grad) < TOL and rel_err(wt.grad, ref_w.grad) < TOL, seq


# --- every shape op: a product axis flows through with the right extent, or is refused --------
def _nothing(g, x) -> tuple:
    return ()


def _plain(g, x) -> tuple:
    """[seq, 6]: the two halves of x's rows summed."""
    halves = g.reduction(g.reshape(x, [2, SEQ, 6]), "sum", axes=[0])
    return (g.reshape(halves, [SEQ, 6]),)


def _other_symbol(g, x) -> tuple:
    return (g.tensor(name="other", dim=[dg.dynamic("other", 1, 37), 6]),)


def _constant(g, x) -> tuple:
    return (g.tensor(name="c", dim=[4, 6]),)


SHAPE_CASES = {
    # name: (operands made first, the op on x [2 * seq, 6] and them, the torch op at any size,
    #        the expected dynamic dims, or None where refused)
    "reshape_merge_static": (_nothing, lambda g, x: g.reshape(x, [2 * SEQ * 6]), lambda t: t.reshape(-1),
                             (12 * SEQ,)),
    "reshape_split_back": (_nothing, lambda g, x: g.reshape(x, [2, SEQ, 6]), lambda t: t.reshape(2, -1, 6),
                           (2, SEQ, 6)),
    "reshape_split_symbol_outer": (_nothing, lambda g, x: g.reshape(x, [SEQ, 2, 3, 2]),
                                   lambda t: t.reshape(-1, 2, 3, 2), (SEQ, 2, 3, 2)),
    "reshape_regroup": (_nothing, lambda g, x: g.reshape(x, [4 * SEQ, 3]), lambda t: t.reshape(-1, 3),
                        (4 * SEQ, 3)),
    "reshape_swap_extents": (_nothing, lambda g, x: g.reshape(x, [6, 2 * SEQ]), lambda t: t.reshape(6, -1),
                             (6, 2 * SEQ)),
    "reshape_literal": (_nothing, lambda g, x: g.reshape(x, [2 * 37, 6]), None, None),
    "reshape_split_neither_symbol": (_nothing, lambda g, x: g.reshape(x, [37, 12]), None, None),
    "transpose": (_nothing, lambda g, x: g.transpose(x, [1, 0]), lambda t: t.t(), (6, 2 * SEQ)),
    # a slice names its bounds at the max: a whole dynamic axis (0:74) is out of range below it, as
    # for an axis of one symbol (slicing beside a dynamic axis wants a "to its end" bound: not yet)
    "slice_beside": (_nothing, lambda g, x: g.slice(x, [slice(None), slice(1, 5, 2)]), None, None),
    "slice_over": (_nothing, lambda g, x: g.slice(x, [slice(0, 74), slice(None)]), None, None),
    "slice_over_step": (_nothing, lambda g, x: g.slice(x, [slice(0, 74, 2), slice(None)]), None, None),
    "concat_along_itself": (_nothing, lambda g, x: g.concatenate([x, x], axis=0), lambda t: torch.cat([t, t], 0),
                            (4 * SEQ, 6)),
    "concat_beside": (_nothing, lambda g, x: g.concatenate([x, g.relu(x)], axis=1),
                      lambda t: torch.cat([t, t.relu()], 1), (2 * SEQ, 12)),
    "concat_with_plain_symbol": (_plain, lambda g, x, plain: g.concatenate([x, plain], axis=0),
                                 lambda t: torch.cat([t, t.reshape(2, -1, 6).sum(0)], 0), (3 * SEQ, 6)),
    "concat_with_other_symbol": (_other_symbol, lambda g, x, other: g.concatenate([x, other], axis=0), None, None),
    "concat_with_constant": (_constant, lambda g, x, c: g.concatenate([x, c], axis=0), None, None),
}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_every_shape_op_keeps_a_product_axis_exact_or_refuses_it(case):
    setup, make, torch_op, expected = SHAPE_CASES[case]
    g = _graph(case)
    x = g.reshape(g.tensor(name="x", dim=[2, SEQ, 6]), [2 * SEQ, 6], name="rows")
    operands = setup(g, x)
    if expected is None:
        before = ([t.name for t in g.tensors], [n.name for n in g.nodes])
        with pytest.raises(dg.UnsupportedError):
            make(g, x, *operands)
        assert ([t.name for t in g.tensors], [n.name for n in g.nodes]) == before  # added nothing
        return
    y = make(g, x, *operands).set_output(True)
    assert y.dynamic_dim == expected  # never made static: each varying axis is its multiple
    for seq in SIZES:  # the graph at each size has the dims torch's op gives
        assert list(g.specialised({"seq": seq}).tensor_by_name(y.name).dim) == \
            list(torch_op(torch.empty(2 * seq, 6)).shape), seq
    g.build()
    for seq in (1, 19):
        xt = torch.randn(2, seq, 6)
        out = _poisoned_for(y, {"seq": seq})
        g.execute({"x": xt, y: out})
        expected_values = torch_op(xt.double().reshape(2 * seq, 6))
        assert out.shape == expected_values.shape and rel_err(out, expected_values) < TOL, seq


# --- typed errors --------------------------------------------------------------------------------
def test_multiples_and_what_cannot_be_one_are_typed_errors_that_add_nothing():
    g = _graph("refused")
    x = g.tensor(name="x", dim=[2, SEQ, 6])
    rows = g.reshape(x, [2 * SEQ, 6])
    names = [t.name for t in g.tensors]
    with pytest.raises(dg.UnsupportedError, match="constant multiple"):
        g.reshape(rows, [3, 37, 4])  # [2 * seq, 6] -> [x, y, 4]: neither x nor y is a symbol
    with pytest.raises(dg.UnsupportedError, match="one symbol"):
        g.tensor(name="product_input", dim=[2 * SEQ, 6])  # an input's dynamic axis is one symbol
    with pytest.raises(dg.ValidationError, match="no multiple"):
        g.reshape(rows, [2 * dg.dynamic("other", 1, 37), 6])
    batch = dg.dynamic("batch", 1, 4)
    both = g.tensor(name="both", dim=[batch, SEQ, 6])
    with pytest.raises(dg.UnsupportedError, match="seq|batch"):
        g.reshape(both, [batch * 37, 6])  # a product of two symbols
    for coefficient in (0, -2, True, 2.0):
        with pytest.raises(dg.ValidationError):
            Multiple(SEQ, coefficient)
        with pytest.raises(dg.ValidationError, match="integer"):
            SEQ * coefficient
    with pytest.raises(dg.UnsupportedError, match="two symbols"):
        batch * SEQ
    with pytest.raises(dg.UnsupportedError, match="two symbols"):
        2 * SEQ * (3 * batch)
    assert 3 * (2 * SEQ) == SEQ * 6 == Multiple(SEQ, 6) and 1 * SEQ == SEQ
    with pytest.raises(dg.ValidationError, match="2\\*\\*48"):
        dg.dynamic("huge", 1, 2 ** 47) * 4
    assert [t.name for t in g.tensors] == names + ["both"]


def test_probes_tell_a_constant_multiple_from_other_motions():
    """propagate sees an axis at the max and at two probe sizes (max - 1 and the min): c * s
    passes, and a motion that agrees with c * s at the max and one probe only is refused."""
    g = _graph("probes")
    x = g.tensor(name="x", dim=[SEQ, 4])
    motions = {
        "three_s": (lambda s: 3 * s, Multiple(SEQ, 3)),
        "s": (lambda s: s, SEQ),
        "s_plus_4": (lambda s: s + 4, None),
        "two_s_but_at_the_min": (lambda s: 2 * s if s > 1 else 5, None),
        "two_s_but_below_the_max": (lambda s: 2 * s if s != 36 else 70, None),
        "half": (lambda s: (s + 1) // 2, None),
    }
    for name, (motion, expected) in motions.items():
        def infer(inputs, attrs, motion=motion):
            return [OutputSpec((motion(inputs[0].dim[0]), 4))]
        if expected is None:
            with pytest.raises(dg.UnsupportedError, match="seq"):
                propagate(name, infer, [x], None, infer([x], None))
        else:
            assert propagate(name, infer, [x], None, infer([x], None)) == [(expected, None)], name


# --- a transformer block written with the reshapes every Llama/GPT block does --------------------
def _batched_attention_block(seq, batch, heads, head, io_type):
    """x [batch, seq, dim] -> rmsnorm -> [batch * seq, dim] @ wq/wk/wv -> [batch, seq, heads, head]
    -> [batch, heads, seq, head] -> causal sdpa -> [batch, seq, heads, head] -> [batch * seq, dim]
    @ wo -> [batch, seq, dim] + x: one dynamic graph, the sequence length a symbol throughout."""
    dim = heads * head
    g = dg.Graph(name="block", io_data_type=io_type)
    x = g.tensor(name="x", dim=[batch, seq, dim])
    weights = {name: g.tensor(name=name, dim=[dim, dim]) for name in ("wq", "wk", "wv", "wo")}
    h, _ = g.rmsnorm(x, g.tensor(name="norm", dim=[1, 1, dim]), norm_forward_phase="inference")
    rows = g.reshape(h, [batch * seq, dim])
    q, k, v = (g.transpose(g.reshape(g.matmul(rows, weights[name]), [batch, seq, heads, head]), [0, 2, 1, 3])
               for name in ("wq", "wk", "wv"))
    o, _ = g.sdpa(q, k, v, attn_scale=head ** -0.5, use_causal_mask=True)
    merged = g.reshape(g.transpose(o, [0, 2, 1, 3]), [batch * seq, dim])
    y = g.add(x, g.reshape(g.matmul(merged, weights["wo"]), [batch, seq, dim])).set_output(True)
    return g, rows, y


def test_batched_attention_block_with_merged_rows_runs_every_size():
    g, rows, y = _batched_attention_block(SEQ, batch=2, heads=2, head=8, io_type=dg.float32)
    assert rows.dynamic_dim == (2 * SEQ, 16) and y.dynamic_dim == (2, SEQ, 16)
    g.build()
    for seq in SIZES:
        inputs = {t.name: torch.randn(*_dims_at(t, {"seq": seq})) * 0.3 for t in g.inputs()}
        out = _poisoned_for(y, {"seq": seq})
        g.execute({**inputs, y: out})
        assert rel_err(out, g.reference(inputs)[y.name]) < 1e-4, seq


@pytest.mark.gpu
def test_batched_attention_block_three_sequence_lengths_one_build_gpu():
    g, _, y = _batched_attention_block(dg.dynamic("seq", 1, 4096), batch=2, heads=8, head=64, io_type=dg.bfloat16)
    g.build()
    for seq in (1000, 777, 4095):  # 1000 and 777 share the bucket of 1024 (2 * seq rows: 2048's)
        inputs = {t.name: (torch.randn(*_dims_at(t, {"seq": seq})) * 0.3).to("cuda", torch.bfloat16)
                  for t in g.inputs()}
        out = _poisoned_for(y, {"seq": seq}).to("cuda", torch.bfloat16)
        g.execute({**inputs, y: out})
        assert rel_err(out, g.reference(inputs)[y.name]) < 2e-2, seq


def _compiled_as(launch) -> tuple:
    """What Triton compiles a launch into, beyond the integers it specializes by value (as in
    test_dynamic.py): the kernel (named by its source's content), its constexprs, warps, stages."""
    constexprs = tuple((a.name, a.value) for a in launch.arguments if a.kind == "constexpr")
    return launch.kernel.__name__, constexprs, launch.num_warps, launch.num_stages


PRODUCT_BUCKETS = ((3, 4), (5, 7, 8), (17, 24, 31), (65, 100, 128), (513, 777, 1000, 1024), (2049, 3000, 4096))


def test_batched_attention_block_planned_for_the_h200_compiles_once_per_bucket():
    """Axes of 2 * seq vary with seq: the matmuls' rows are planned at twice the bucket's top,
    and every size of a bucket compiles what its top does."""
    g, _, _ = _batched_attention_block(dg.dynamic("seq", 1, 4096), batch=2, heads=8, head=64, io_type=dg.bfloat16)
    g.build(options=dg.BuildOptions(target=dg.target.H200))
    per_bucket = {}
    for sizes in PRODUCT_BUCKETS:
        compiled = {tuple(_compiled_as(launch) for launch in g.plan.plan_for((s,)).launches) for s in sizes}
        assert len(compiled) == 1, sizes
        per_bucket[sizes] = compiled.pop()
    assert len(set(per_bucket.values())) > 2  # the choices do change between buckets


def test_as_function_with_a_product_output_traces_once_under_torch_compile_dynamic():
    """The traced op's fake output of [2 * seq, 4] is twice the input's symbolic seq: one dynamo
    graph serves every size, and a reshape after it in torch sees the right extent."""
    from torch._dynamo.utils import counters

    g = _graph("traced")
    x = g.tensor(name="x", dim=[2, SEQ, 6])
    w = g.tensor(name="w", dim=[6, 4])
    g.tanh(g.matmul(g.reshape(x, [2 * SEQ, 6]), w)).set_output(True)
    fn = g.as_function()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda a, b: fn(a, b).reshape(2, -1, 4) * 2, fullgraph=True, dynamic=True)
    for seq in (3, 7, 9):
        xt, wt = torch.randn(2, seq, 6), torch.randn(6, 4)
        got = compiled(xt, wt)
        assert got.shape == (2, seq, 4)
        assert rel_err(got, torch.tanh(xt.double() @ wt.double()) * 2) < TOL, seq
    assert counters["stats"]["unique_graphs"] == 1
