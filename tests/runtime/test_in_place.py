"""In-place execution: an output bound to the very memory of an input (runtime/in_place.py).

Runs where every kernel reading the input reads each element before the writer stores it: a
pointwise chain (strided, broadcast operands), rotary embedding written back into x's halves,
batchnorm's running statistics in every row mode, a reader in another kernel ordered before the
writer. Refused with ExecutionError, writing nothing, everywhere else: a matmul over its A
operand, a view shifted by one element, the same bytes in another index order (a transpose), a
reader that must run after the writer, a row kernel's element output over its input."""
import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from helpers import rel_err
from rowmodes import row_options


def _graph():
    return dg.Graph(io_data_type=dg.float32, intermediate_data_type=dg.float32, compute_data_type=dg.float32)


def _refused(graph, bindings, watched):
    """execute() raises ExecutionError naming an overlap and changes none of `watched`."""
    before = [t.clone() for t in watched]
    with pytest.raises(dg.ExecutionError, match="overlaps"):
        graph.execute(bindings)
    for tensor, kept in zip(watched, before):
        assert torch.equal(tensor, kept) or (torch.isnan(kept).any() and torch.equal(tensor.isnan(), kept.isnan()))


@pytest.mark.parametrize("strided", [False, True])
def test_pointwise_chain_in_place(strided):
    xt = torch.randn(13, 37) if not strided else torch.randn(37, 13).t()
    g = _graph()
    x = g.tensor_like(xt, name="x")
    b = g.tensor(name="b", dim=[1, 37])  # broadcast operand
    y = g.tanh(g.add(g.mul(x, x), b)).set_output(True)
    g.build()
    bt = torch.randn(1, 37)
    expected = g.reference({x: xt.clone(), b: bt})[y.name]
    g.execute({x: xt, b: bt, y: xt})
    assert rel_err(xt, expected) < 2e-5


def test_rotary_written_back_into_x():
    """x's two halves are bound as inputs and as the outputs: each program reads x1[i] and x2[i]
    and writes both at i."""
    batch, seq, dim = 2, 9, 16
    memory = torch.randn(batch, seq, dim)
    x1_t, x2_t = memory[..., :dim // 2], memory[..., dim // 2:]
    angles = torch.randn(1, seq, dim // 2)
    g = _graph()
    x1, x2 = g.tensor_like(x1_t, name="x1"), g.tensor_like(x2_t, name="x2")
    cos, sin = g.tensor(name="cos", dim=[1, seq, dim // 2]), g.tensor(name="sin", dim=[1, seq, dim // 2])
    y1 = g.sub(g.mul(x1, cos), g.mul(x2, sin)).set_output(True).set_stride(list(x1_t.stride()))
    y2 = g.add(g.mul(x2, cos), g.mul(x1, sin)).set_output(True).set_stride(list(x2_t.stride()))
    g.build()
    assert len(g.plan.launches) == 1  # the two halves' chains are one kernel (sibling fusion)
    inputs = {x1: x1_t, x2: x2_t, cos: angles.cos(), sin: angles.sin()}
    expected = g.reference({k: v.clone() for k, v in inputs.items()})
    g.execute({**inputs, y1: x1_t, y2: x2_t})
    assert rel_err(x1_t, expected[y1.name]) < 2e-5 and rel_err(x2_t, expected[y2.name]) < 2e-5
    # the halves swapped: still each element read, at its index, before any store there
    expected = g.reference({k: v.clone() for k, v in inputs.items()})
    g.execute({**inputs, y1: x2_t, y2: x1_t})
    assert rel_err(x2_t, expected[y1.name]) < 2e-5 and rel_err(x1_t, expected[y2.name]) < 2e-5
    # shifted by one element along the row: refused
    _refused(g, {**inputs, y1: memory[..., 1:dim // 2 + 1], y2: x2_t}, [memory])


@pytest.mark.parametrize("mode", ["one_pass", "looped", "split"])
def test_batchnorm_running_statistics_in_place(mode):
    g = _graph()
    x = g.tensor(name="x", dim=[3, 5, 4, 6])
    s, b = g.tensor(name="scale", dim=[1, 5, 1, 1]), g.tensor(name="bias", dim=[1, 5, 1, 1])
    rm, rv = g.tensor(name="rm", dim=[1, 5, 1, 1]), g.tensor(name="rv", dim=[1, 5, 1, 1])
    outs = g.batchnorm(x, s, b, rm, rv, momentum=0.3)
    for out in outs:
        out.set_output(True)
    g.build(options=row_options(mode))
    xt = torch.randn(3, 5, 4, 6) * 2 + 1
    running_mean, running_var = torch.randn(1, 5, 1, 1), torch.rand(1, 5, 1, 1) + 0.5
    inputs = {x: xt, s: torch.randn(1, 5, 1, 1), b: torch.randn(1, 5, 1, 1), rm: running_mean, rv: running_var}
    expected = g.reference({k: v.clone() for k, v in inputs.items()})
    bound = {out: torch.full(out.dim, float("nan")) for out in outs[:3]}
    g.execute({**inputs, **bound, outs[3]: running_mean, outs[4]: running_var})
    assert rel_err(running_mean, expected[outs[3].name]) < 2e-5
    assert rel_err(running_var, expected[outs[4].name]) < 2e-5
    for out, value in bound.items():
        assert rel_err(value, expected[out.name]) < 2e-5
    # the running mean over the running variance: another pair, refused
    _refused(g, {**inputs, **bound, outs[3]: running_var, outs[4]: torch.empty(1, 5, 1, 1)}, [running_var])


@pytest.mark.parametrize("mode", ["one_pass", "looped", "split"])
@pytest.mark.parametrize("second_reader", ["epilogue", "bias slot"])
def test_running_statistics_read_twice_in_their_group_are_refused(mode, second_reader):
    """The running mean read by a fused epilogue, or also bound as batchnorm's bias: in split
    mode the launch after the combine would read the overwritten value, so no mode takes it."""
    g = _graph()
    x = g.tensor(name="x", dim=[3, 5, 4, 6])
    s, b = g.tensor(name="scale", dim=[1, 5, 1, 1]), g.tensor(name="bias", dim=[1, 5, 1, 1])
    rm, rv = g.tensor(name="rm", dim=[1, 5, 1, 1]), g.tensor(name="rv", dim=[1, 5, 1, 1])
    outs = g.batchnorm(x, s, rm if second_reader == "bias slot" else b, rm, rv, momentum=0.3)
    y = g.add(outs[0], rm).set_output(True) if second_reader == "epilogue" else outs[0].set_output(True)
    for out in outs[1:]:
        out.set_output(True)
    g.build(options=row_options(mode))
    assert not any(uid == rm.uid for _, uid in g.plan.in_place)
    xt, running_mean = torch.randn(3, 5, 4, 6), torch.randn(1, 5, 1, 1)
    inputs = {x: xt, s: torch.randn(1, 5, 1, 1), b: torch.randn(1, 5, 1, 1), rm: running_mean,
              rv: torch.rand(1, 5, 1, 1) + 0.5}
    bound = {out: torch.full(out.dim, float("nan")) for out in outs[1:3]}
    _refused(g, {**inputs, **bound, y: torch.full(y.dim, float("nan")), outs[3]: running_mean,
                 outs[4]: torch.empty(1, 5, 1, 1)}, [running_mean])


def test_matmul_output_over_its_operand_is_refused():
    g = _graph()
    a, b = g.tensor(name="a", dim=[1, 16, 16]), g.tensor(name="b", dim=[1, 16, 16])
    c = g.relu(g.matmul(a, b)).set_output(True)
    g.build(options=dg.BuildOptions(matmul_config=mm.MatmulConfig("tiled", 16, 16, 16, 4, 2)))
    at, bt = torch.randn(1, 16, 16), torch.randn(1, 16, 16)
    _refused(g, {a: at, b: bt, c: at}, [at, bt])
    _refused(g, {a: at, b: bt, c: bt}, [at, bt])


def test_row_kernel_element_output_over_its_input_is_refused():
    """A softmax reads the whole row before storing: not one program per element."""
    g = _graph()
    x = g.tensor(name="x", dim=[4, 50])
    y = g.softmax(x, axis=-1).set_output(True)
    g.build()
    xt = torch.randn(4, 50)
    _refused(g, {x: xt, y: xt}, [xt])


def test_shifted_and_transposed_views_are_refused():
    g = _graph()
    x = g.tensor(name="x", dim=[6, 6])
    y = g.exp(x).set_output(True)
    g.build()
    memory = torch.randn(40)
    xt = memory[:36].view(6, 6)
    _refused(g, {x: xt, y: memory[1:37].view(6, 6)}, [memory])  # one element along
    g2 = _graph()
    x2 = g2.tensor(name="x", dim=[6, 6])
    y2 = g2.exp(x2).set_output(True).set_stride([1, 6])
    g2.build()
    _refused(g2, {x2: xt, y2: xt.t()}, [memory])  # the same bytes, another order


def test_a_reader_after_the_writer_is_refused():
    """z needs y, which overwrote x, and also reads x: no order reads x first."""
    g = _graph()
    x = g.tensor(name="x", dim=[5, 8])
    y = g.exp(x).set_output(True)
    s = g.reduction(y, mode="sum", axes=[1])
    z = g.add(g.sin(x), s).set_output(True)
    g.build()
    xt = torch.randn(5, 8)
    zt = torch.full((5, 8), float("nan"))
    _refused(g, {x: xt, y: xt, z: zt}, [xt, zt])


def test_readers_in_other_kernels_run_before_the_writer():
    """x read by a matmul and by a row reduction, and overwritten by a pointwise kernel: the plan
    orders the writer after both readers, so the binding runs."""
    g = _graph()
    x = g.tensor(name="x", dim=[1, 12, 20])
    w = g.tensor(name="w", dim=[1, 20, 7])
    y = g.sigmoid(x).set_output(True)  # declared first: the graph order would run it first
    mm_out = g.matmul(x, w).set_output(True)
    top = g.reduction(x, mode="max", axes=[2]).set_output(True)
    g.build()
    xt, wt = torch.randn(1, 12, 20), torch.randn(1, 20, 7)
    expected = g.reference({x: xt.clone(), w: wt})
    uids = lambda tensors: {t.uid for t in tensors}
    writer = next(i for i, launch in enumerate(g.plan.launches) if y.uid in uids(launch.group.outputs))
    readers = [i for i, launch in enumerate(g.plan.launches) if x.uid in uids(launch.group.inputs) and i != writer]
    assert len(readers) == 2 and all(i < writer for i in readers)
    out_mm, out_top = torch.full((1, 12, 7), float("nan")), torch.full((1, 12, 1), float("nan"))
    g.execute({x: xt, w: wt, y: xt, mm_out: out_mm, top: out_top})
    for name, value in ((y.name, xt), (mm_out.name, out_mm), (top.name, out_top)):
        assert rel_err(value, expected[name]) < 2e-5, name


@pytest.mark.parametrize("reader", ["matmul", "layernorm"])
def test_a_reader_whose_output_has_the_inputs_dims_runs_before_the_writer(reader):
    """x overwritten by a pointwise kernel declared first, and read by an anchor whose own output
    has x's dims and type (a square matmul, a layernorm): that output is no in-place candidate
    (the anchor's kernel reads x across programs), so the anchor runs first and the binding runs."""
    g = _graph()
    x = g.tensor(name="x", dim=[9, 9])
    y = g.exp(x).set_output(True)
    if reader == "matmul":
        w = g.tensor(name="w", dim=[9, 9])
        z = g.matmul(x, w).set_output(True)
        extra = {w: torch.randn(9, 9)}
    else:
        s, b = g.tensor(name="s", dim=[1, 9]), g.tensor(name="b", dim=[1, 9])
        z = g.layernorm(x, s, b, norm_forward_phase="inference")[0].set_output(True)
        extra = {s: torch.randn(1, 9), b: torch.randn(1, 9)}
    g.build()
    xt = torch.randn(9, 9)
    expected = g.reference({x: xt.clone(), **extra})
    out_z = torch.full((9, 9), float("nan"))
    g.execute({x: xt, y: xt, z: out_z, **extra})
    assert rel_err(xt, expected[y.name]) < 2e-5 and rel_err(out_z, expected[z.name]) < 2e-5


@pytest.mark.parametrize("declared_first", ["writer", "reader"])
def test_a_reader_through_a_view_runs_before_the_writer(declared_first):
    """x read through a transposed view (its copy or its consumer is another kernel) and
    overwritten by a pointwise kernel: whichever the graph declares first, the writer runs last."""
    g = _graph()
    x = g.tensor(name="x", dim=[9, 9])
    if declared_first == "writer":
        y = g.exp(x).set_output(True)
        z = g.reduction(g.transpose(x, [1, 0]), mode="sum", axes=[1]).set_output(True)
    else:
        z = g.reduction(g.transpose(x, [1, 0]), mode="sum", axes=[1]).set_output(True)
        y = g.exp(x).set_output(True)
    g.build()
    xt = torch.randn(9, 9)
    expected = g.reference({x: xt.clone()})
    out_z = torch.full((9, 1), float("nan"))
    g.execute({x: xt, y: xt, z: out_z})
    assert rel_err(xt, expected[y.name]) < 2e-5 and rel_err(out_z, expected[z.name]) < 2e-5


def test_as_function_unaffected():
    g = _graph()
    x = g.tensor(name="x", dim=[3, 4])
    g.exp(x).set_output(True)
    xt = torch.randn(3, 4)
    out = g.as_function()(xt)
    assert out.data_ptr() != xt.data_ptr()
    torch.testing.assert_close(out, xt.exp())


@pytest.mark.gpu
def test_in_place_on_cuda():
    """Rotary halves and batchnorm running statistics in place through the prepared launches."""
    batch, seq, dim = 4, 128, 64
    memory = torch.randn(batch, seq, dim, device="cuda")
    x1_t, x2_t = memory[..., :dim // 2], memory[..., dim // 2:]
    angles = torch.randn(1, seq, dim // 2, device="cuda")
    g = _graph()
    x1, x2 = g.tensor_like(x1_t, name="x1"), g.tensor_like(x2_t, name="x2")
    cos, sin = g.tensor(name="cos", dim=[1, seq, dim // 2]), g.tensor(name="sin", dim=[1, seq, dim // 2])
    y1 = g.sub(g.mul(x1, cos), g.mul(x2, sin)).set_output(True).set_stride(list(x1_t.stride()))
    y2 = g.add(g.mul(x2, cos), g.mul(x1, sin)).set_output(True).set_stride(list(x2_t.stride()))
    g.build()
    inputs = {x1: x1_t, x2: x2_t, cos: angles.cos(), sin: angles.sin()}
    expected = g.reference({k: v.cpu().clone() for k, v in inputs.items()})
    for _ in range(2):  # the second execute takes the prepared launch path
        g.execute({**inputs, y1: x1_t, y2: x2_t})
        assert rel_err(x1_t, expected[y1.name]) < 2e-5 and rel_err(x2_t, expected[y2.name]) < 2e-5
        expected = g.reference({k: v.cpu().clone() for k, v in inputs.items()})
    # batchnorm's running statistics updated in place, in the split mode too
    for mode in ("one_pass", "split"):
        g = _graph()
        x = g.tensor(name="x", dim=[32, 64, 14, 14])
        s, b = g.tensor(name="scale", dim=[1, 64, 1, 1]), g.tensor(name="bias", dim=[1, 64, 1, 1])
        rm, rv = g.tensor(name="rm", dim=[1, 64, 1, 1]), g.tensor(name="rv", dim=[1, 64, 1, 1])
        outs = g.batchnorm(x, s, b, rm, rv, momentum=0.1)
        for out in outs:
            out.set_output(True)
        g.build(options=dg.BuildOptions(row_mode=mode))
        inputs = {x: torch.randn(32, 64, 14, 14, device="cuda"), s: torch.randn(1, 64, 1, 1, device="cuda"),
                  b: torch.randn(1, 64, 1, 1, device="cuda"), rm: torch.randn(1, 64, 1, 1, device="cuda"),
                  rv: torch.rand(1, 64, 1, 1, device="cuda") + 0.5}
        expected = g.reference({k: v.cpu().clone() for k, v in inputs.items()})
        bound = {out: torch.empty(out.dim, device="cuda") for out in outs[:3]}
        g.execute({**inputs, **bound, outs[3]: inputs[rm], outs[4]: inputs[rv]})
        assert rel_err(inputs[rm], expected[outs[3].name]) < 2e-5
        assert rel_err(inputs[rv], expected[outs[4].name]) < 2e-5
