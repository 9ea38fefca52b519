"""Recurrent layers (g.rnn, rnn_recurrence): kernels against the float64 reference and against
torch's nn.RNN / nn.LSTM / nn.GRU with the same weights, gradients through as_function, lengths
(0 and 1 included), the streamed-weight path, typed errors. Tiny sizes: the interpreter is slow."""
import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.lower import rnn as rnn_lowering
from helpers import check, compiled_for_sm90, poisoned, rel_err, run

TORCH_MODULES = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN, "rnn_relu": torch.nn.RNN}


def torch_module(mode, input_size, hidden, layers=1, bidirectional=False, proj=0, bias=True):
    kwargs = {"num_layers": layers, "bidirectional": bidirectional, "bias": bias}
    if proj:
        kwargs["proj_size"] = proj
    if mode == "rnn_relu":
        kwargs["nonlinearity"] = "relu"
    return TORCH_MODULES[mode](input_size, hidden, **kwargs).double()


class Case:
    """A graph of g.rnn with the module's weights as inputs, and the torch values to feed."""

    def __init__(self, mode, steps=4, batch=3, input_size=3, hidden=5, layers=1, bidirectional=False, proj=0,
                 lengths=None, dtype=dg.float32, bias=True, batch_first=False, **rnn_kwargs):
        torch.manual_seed(hash((mode, steps, batch, hidden, layers, bidirectional, proj)) % 1000)
        self.mode, self.steps, self.lengths = mode, steps, lengths
        self.module = torch_module(mode, input_size, hidden, layers, bidirectional, proj, bias)
        slots, state = layers * (2 if bidirectional else 1), proj or hidden
        shape = (batch, steps, input_size) if batch_first else (steps, batch, input_size)
        torch_type = dtype.torch_dtype
        # values the graph's type holds exactly: torch in float64 sees what the graph is fed
        exact = (lambda *dims: torch.randn(*dims, dtype=torch.float64).to(torch_type).double())
        self.x = exact(*shape)
        self.h0 = exact(slots, batch, state)
        self.c0 = exact(slots, batch, hidden) if mode == "lstm" else None
        with torch.no_grad():
            for weight in self.module._flat_weights:
                weight.copy_(weight.to(torch_type).double())
        self.graph = g = dg.Graph(name="rnn", io_data_type=dtype)
        self.inputs = [g.tensor_like(self.x.to(torch_type), name="x"), g.tensor_like(self.h0.to(torch_type), name="h0")]
        c0 = g.tensor_like(self.c0.to(torch_type), name="c0") if self.c0 is not None else None
        if c0 is not None:
            self.inputs.append(c0)
        self.weights = [w.detach() for w in self.module._flat_weights]
        weights = [g.tensor_like(w.to(torch_type), name=f"w{i}") for i, w in enumerate(self.weights)]
        self.inputs += weights
        self.lengths_t = lengths_t = g.tensor_like(lengths, name="lengths") if lengths is not None else None
        self.y, self.h_n, self.c_n = g.rnn(self.inputs[0], self.inputs[1], c0, weights, mode=mode, num_layers=layers,
                                           bidirectional=bidirectional, proj_size=proj, seq_lengths=lengths_t,
                                           bias=bias, batch_first=batch_first, **rnn_kwargs)
        self.outputs = [t for t in (self.y, self.h_n, self.c_n) if t is not None]
        for tensor in self.outputs:
            tensor.set_output(True)
        self.torch_type = torch_type

    def feeds(self) -> dict:
        values = {"x": self.x, "h0": self.h0, **({"c0": self.c0} if self.c0 is not None else {}),
                  **{f"w{i}": w for i, w in enumerate(self.weights)}}
        values = {k: v.to(self.torch_type) for k, v in values.items()}
        if self.lengths is not None:
            values["lengths"] = self.lengths
        return values

    def torch_outputs(self, x, h0, c0, weights=None):
        """(y, h_n[, c_n]) of the module in float64, lengths through packed sequences."""
        module = self.module
        state = (h0, c0) if self.mode == "lstm" else h0
        if self.lengths is not None:
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, self.lengths, enforce_sorted=False)
            out, final = module(packed, state)
            y = torch.nn.utils.rnn.pad_packed_sequence(out, total_length=self.steps)[0]
        else:
            y, final = module(x, state)
        return [y] + (list(final) if self.mode == "lstm" else [final])


FORWARD_CASES = [
    dict(mode="lstm"),
    dict(mode="lstm", layers=2, bidirectional=True, proj=2, lengths=torch.tensor([4, 1, 3])),
    dict(mode="gru", hidden=7, bidirectional=True, lengths=torch.tensor([2, 4, 1])),
    dict(mode="rnn_tanh", layers=2, batch=1),
    dict(mode="rnn_relu", hidden=1, bidirectional=True),
    dict(mode="gru", hidden=1, batch=1, steps=1),
    dict(mode="lstm", batch_first=True, bias=False, lengths=torch.tensor([3, 4, 2], dtype=torch.int32)),
]


@pytest.mark.parametrize("params", FORWARD_CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()
                                                                          if k != "lengths"))
def test_forward_matches_reference_and_torch(params):
    case = Case(**params)
    check(case.graph, case.feeds())  # poisoned outputs against g.reference (float64)
    ref = case.graph.reference(case.feeds())
    x = case.x.transpose(0, 1) if params.get("batch_first") else case.x
    expected = case.torch_outputs(x, case.h0, case.c0)
    if params.get("batch_first"):
        expected[0] = expected[0].transpose(0, 1)
    with torch.no_grad():
        for tensor, want in zip(case.outputs, expected):
            assert rel_err(ref[tensor.name], want) < 1e-12, tensor.name


def test_lengths_zero_and_one_keep_the_state():
    """A length-0 entry: y all zero, h_n = h0, c_n = c0; a length-1 entry one step."""
    lengths = torch.tensor([0, 1, 3])
    case = Case("lstm", steps=3, bidirectional=True, lengths=lengths)
    outputs = run(case.graph, case.feeds())
    check(case.graph, case.feeds())
    y, h_n, c_n = (outputs[t.name] for t in case.outputs)
    assert torch.equal(y[:, 0], torch.zeros_like(y[:, 0]))
    assert torch.equal(y[1:, 1], torch.zeros_like(y[1:, 1]))
    assert torch.equal(h_n[:, 0], case.h0[:, 0].float())
    assert torch.equal(c_n[:, 0], case.c0[:, 0].float())


@pytest.mark.parametrize("dtype", [dg.bfloat16, dg.float16])
def test_sixteen_bit_weights(dtype):
    case = Case("lstm", layers=2, bidirectional=True, lengths=torch.tensor([4, 2, 3]), dtype=dtype)
    check(case.graph, case.feeds(), dtype=dtype.torch_dtype, tolerance=3e-2)


def test_streamed_weights_and_several_tiles(monkeypatch):
    """Hidden and state wider than one tile: weights read per step, several hidden blocks and K
    tiles per step, forward and backward (the path large layers take on the GPU)."""
    monkeypatch.setattr(rnn_lowering, "CPU_BLOCK", 16)
    for mode, proj in (("gru", 0), ("lstm", 17)):
        case = Case(mode, steps=2, batch=2, input_size=2, hidden=19, proj=proj, lengths=torch.tensor([2, 1]),
                    bidirectional=mode == "gru")
        check(case.graph, case.feeds())
        if proj:
            _check_gradients(case)


def test_a_launch_per_step_for_wide_layers(monkeypatch):
    """The GPU schedule of a layer wider than one tile: an initial-state launch, then one launch
    per step over (batch block, hidden block) programs; outputs and gradients as before."""
    real_schedule = rnn_lowering.schedule_rnn
    monkeypatch.setattr(rnn_lowering, "schedule_rnn", lambda geometry, interpreted, *rest: real_schedule(
        geometry, False, *rest))
    for mode in ("lstm", "gru", "rnn_tanh"):
        case = Case(mode, steps=3, batch=2, input_size=2, hidden=70, lengths=torch.tensor([3, 1]),
                    bidirectional=mode == "lstm")
        check(case.graph, case.feeds())
        text = case.graph.explain()
        assert "launches per step (3 + 1 for the initial state)" in text and "grid=1x2" in text
        if mode == "gru":
            _check_gradients(case)
    for mode in ("lstm", "gru"):  # the backward alone: two launches per step
        g = _recurrence_graph(mode, 70, 0, dg.float32, True)
        sizes = {t.name: t.dim for t in g.inputs()}
        values = {name: torch.randn(*dims) * 0.5 for name, dims in sizes.items() if name != "n"}
        check(g, {**values, "n": torch.tensor([5, 0, 2], dtype=torch.int32)})
        assert "launches per step (10 + 1 for the initial state)" in g.explain()


def test_non_contiguous_operands():
    """x as a strided view, a weight stored transposed (column-major)."""
    case = Case("gru", steps=3, batch=2, hidden=4)
    g = dg.Graph(name="strided", io_data_type=dg.float32)
    x_big = torch.randn(3, 4, 3, dtype=torch.float64).float().double()
    x_view = x_big[:, ::2]
    x = g.tensor_like(x_view.float(), name="x")
    h0 = g.tensor_like(case.h0.float(), name="h0")
    w_hh = case.weights[1].t().contiguous().t()  # same values, strides (1, rows)
    weights = [g.tensor_like(w.float(), name=f"w{i}") for i, w in enumerate([case.weights[0], w_hh] + case.weights[2:])]
    y, h_n, _ = g.rnn(x, h0, None, weights, mode="gru")
    y.set_output(True)
    h_n.set_output(True)
    feeds = {"x": x_view.float(), "h0": case.h0.float(), **{f"w{i}": w.float() for i, w in
                                                            enumerate([case.weights[0], w_hh] + case.weights[2:])}}
    assert weights[1].stride == (1, 12)
    check(g, feeds)
    ref = g.reference(feeds)
    y_t, h_t = case.module(x_view, case.h0)
    assert rel_err(ref[y.name], y_t) < 1e-12 and rel_err(ref[h_n.name], h_t) < 1e-12


def test_dropout_between_layers():
    case = Case("rnn_tanh", steps=3, layers=3, dropout=0.5, dropout_seed=7, dropout_offset=11)
    outputs = run(case.graph, case.feeds())
    check(case.graph, case.feeds())
    no_drop = Case("rnn_tanh", steps=3, layers=3)
    plain = run(no_drop.graph, no_drop.feeds())
    assert not torch.allclose(outputs[case.y.name], plain[no_drop.y.name])


def test_dropout_seed_and_offset_tensors():
    """One built graph, the mask drawn from seed and offset tensors: a new offset, a new mask."""
    case = Case("rnn_tanh", steps=2, layers=2)
    g = case.graph
    seed = g.tensor(name="seed", dim=[1], data_type=dg.int64)
    offset = g.tensor(name="offset", dim=[1], data_type=dg.int64)
    x, h0, *weights = case.inputs
    y, h_n, _ = g.rnn(x, h0, None, weights, mode="rnn_tanh", num_layers=2, dropout=0.5, dropout_seed=seed,
                      dropout_offset=offset)
    y.set_output(True).set_name("dropped_y")
    h_n.set_output(True).set_name("dropped_h_n")
    feeds = {**case.feeds(), "seed": torch.tensor([5]), "offset": torch.tensor([9])}
    check(g, feeds)
    first = run(g, feeds)["dropped_y"]
    again = run(g, {**feeds, "offset": torch.tensor([10])})["dropped_y"]
    assert not torch.equal(first, again)


def _check_gradients(case, tolerance=1e-4):
    """as_function's autograd (data and weight gradients) against torch's in float64."""
    g = case.graph
    wanted = [t for t in case.inputs]
    lengths = [case.lengths_t] if case.lengths is not None else []
    fn = g.as_function(inputs=wanted + lengths, outputs=case.outputs)
    leaves = [v.float().requires_grad_(True) for v in [case.x, case.h0] + ([case.c0] if case.c0 is not None else [])
              + case.weights]
    outputs = fn(*leaves, *([case.lengths] if case.lengths is not None else []))
    seeds = [torch.randn_like(o) for o in outputs]
    grads = torch.autograd.grad(outputs, leaves, seeds)
    x = case.x.clone().requires_grad_(True)
    h0 = case.h0.clone().requires_grad_(True)
    c0 = case.c0.clone().requires_grad_(True) if case.c0 is not None else None
    expected = case.torch_outputs(x, h0, c0)
    for out, want in zip(outputs, expected):
        assert rel_err(out, want) < tolerance
    params = list(case.module._flat_weights)
    wrt = [x, h0] + ([c0] if c0 is not None else []) + params
    want_grads = torch.autograd.grad(expected, wrt, [s.double() for s in seeds])
    for position, (got, want) in enumerate(zip(grads, want_grads)):
        assert rel_err(got, want) < tolerance, f"gradient {position}"


@pytest.mark.parametrize("params", [
    dict(mode="lstm", steps=3, bidirectional=True, proj=2, lengths=torch.tensor([3, 1, 2])),
    dict(mode="gru", steps=3, bidirectional=True, lengths=torch.tensor([2, 3, 1])),
    dict(mode="rnn_relu", steps=3, layers=2),
], ids=lambda p: p["mode"])
def test_gradients_match_torch(params):
    _check_gradients(Case(**params))


def test_backward_op_matches_reference_with_empty_sequences():
    """rnn_recurrence_backward alone against its float64 reference, lengths 0 and 1 included and
    dh_n only (no dy)."""
    torch.manual_seed(3)
    steps, batch, hidden = 3, 3, 4
    g = dg.Graph(name="bwd", io_data_type=dg.float32)
    values = {"xw": torch.randn(steps, batch, 4 * hidden), "h0": torch.randn(batch, hidden),
              "c0": torch.randn(batch, hidden), "w_hh": torch.randn(4 * hidden, hidden) * 0.5,
              "lengths": torch.tensor([0, 1, 3], dtype=torch.int32), "dh_n": torch.randn(batch, hidden)}
    t = {name: g.tensor_like(v, name=name) for name, v in values.items()}
    _, _, _, h_prev, c_prev, _ = g.rnn_recurrence(t["xw"], t["h0"], t["c0"], t["w_hh"], None, None, t["lengths"],
                                                  mode="lstm", reverse=True)
    dxw, dhh, dh0, dc0, d_proj = g.rnn_recurrence_backward(t["xw"], t["w_hh"], None, None, t["lengths"], h_prev,
                                                           c_prev, None, t["dh_n"], None, mode="lstm", reverse=True)
    assert dhh is None and d_proj is None
    for tensor in (dxw, dh0, dc0):
        tensor.set_output(True)
    check(g, values)
    ref = g.reference(values)
    assert torch.equal(ref[dh0.name][0].float(), values["dh_n"][0])


def test_bad_shapes_are_refused_and_leave_the_graph_unchanged():
    case = Case("lstm")
    g = case.graph
    x, h0, c0, *weights = case.inputs
    before = len(g._nodes)
    with pytest.raises(dg.ValidationError, match="weights"):
        g.rnn(x, h0, c0, weights[:-1], mode="lstm")
    with pytest.raises(dg.ValidationError, match="h0"):
        g.rnn(x, c0 if False else g.tensor(name="h_bad", dim=[1, 3, 4]), c0, weights, mode="lstm")
    with pytest.raises(dg.ValidationError, match="c0"):
        g.rnn(x, h0, None, weights, mode="lstm")
    with pytest.raises(dg.ValidationError, match="proj_size"):
        g.rnn(x, h0, c0, weights, mode="gru", proj_size=2)
    with pytest.raises(dg.ValidationError, match="mode"):
        g.rnn(x, h0, c0, weights, mode="lstm2")
    with pytest.raises(dg.ValidationError, match="int32"):
        g.rnn(g.tensor(name="x_int", dim=[4, 3, 3], data_type=dg.int32), h0, c0, weights, mode="lstm")
    with pytest.raises(dg.ValidationError, match="seq_lengths"):
        g.rnn(x, h0, c0, weights, mode="lstm", seq_lengths=g.tensor(name="float_lengths", dim=[3]))
    assert len(g._nodes) == before
    deep = Case("lstm", layers=2)
    x, h0, c0, *weights = deep.inputs
    before = len(deep.graph._nodes)
    with pytest.raises(dg.ValidationError, match="dropout_seed"):
        deep.graph.rnn(x, h0, c0, weights, mode="lstm", num_layers=2, dropout=0.2)
    with pytest.raises(dg.ValidationError, match="offset"):
        deep.graph.rnn(x, h0, c0, weights, mode="lstm", num_layers=2, dropout=0.2, dropout_seed=1,
                       dropout_offset=deep.graph.tensor(name="float_offset", dim=[1]))
    with pytest.raises(dg.ValidationError, match="dropout_offset"):
        deep.graph.rnn(x, h0, c0, weights, mode="lstm", num_layers=2, dropout=0.2, dropout_seed=1,
                       dropout_offset=2**63 - 2)
    with pytest.raises(dg.ValidationError, match="layer 1 direction 0 w_ih"):
        deep.graph.rnn(x, h0, c0, weights[:4] + weights[:4], mode="lstm", num_layers=2)
    assert len(deep.graph._nodes) == before


def test_lengths_out_of_range_raise_before_any_write():
    case = Case("gru", steps=3, lengths=torch.tensor([3, 1, 2]))
    case.graph.build()
    feeds = case.feeds()
    feeds["lengths"] = torch.tensor([3, 4, 2])
    outputs = {t.name: poisoned(t) for t in case.outputs}
    with pytest.raises(dg.ExecutionError, match="seq_lengths"):
        case.graph.execute({**feeds, **outputs})
    assert all(torch.isnan(o).all() for o in outputs.values())


def test_explain_names_the_persistent_recurrence():
    case = Case("lstm", steps=2, batch=2)
    case.graph.build()
    text = case.graph.explain()
    assert "persistent lstm forward" in text and "kept in registers" in text


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_gpu_benchmark_shape_forward_and_backward(mode):
    """4 layers, hidden 1024, batch 64, 50 steps, bf16: outputs and gradients against float64,
    within a small multiple of cuDNN's own bf16 error (the yardstick of the precision)."""
    torch.manual_seed(0)
    steps, batch, hidden, layers = 50, 64, 1024, 4
    module = TORCH_MODULES[mode](hidden, hidden, num_layers=layers).cuda().bfloat16()
    g = dg.Graph(name="bench", io_data_type=dg.bfloat16)
    x = torch.randn(steps, batch, hidden, device="cuda", dtype=torch.bfloat16)
    h0 = torch.randn(layers, batch, hidden, device="cuda", dtype=torch.bfloat16)
    c0 = torch.randn_like(h0)
    xt, ht = g.tensor_like(x, name="x"), g.tensor_like(h0, name="h0")
    ct = g.tensor_like(c0, name="c0") if mode == "lstm" else None
    weights = [g.tensor_like(w.detach(), name=f"w{i}") for i, w in enumerate(module._flat_weights)]
    y, h_n, c_n = g.rnn(xt, ht, ct, weights, mode=mode, num_layers=layers)
    outs = [t.set_output(True) for t in (y, h_n, c_n) if t is not None]
    fn = g.as_function(inputs=[xt, ht] + ([ct] if ct is not None else []) + weights, outputs=outs)
    values = [x, h0] + ([c0] if ct is not None else [])

    def step(run, cast):
        leaves = [v.to(cast).requires_grad_(True) for v in values]
        params = [w.detach().to(cast).requires_grad_(True) for w in module._flat_weights]
        got = run(leaves, params)
        seeds = [torch.ones_like(o) for o in got]
        return got, torch.autograd.grad(got, leaves + params, seeds)

    def cudnn(leaves, params):
        ref = copy_module(module, params)
        state = (leaves[1], leaves[2]) if mode == "lstm" else leaves[1]
        y_ref, final = ref(leaves[0], state)
        return [y_ref] + (list(final) if mode == "lstm" else [final])

    ours = step(lambda leaves, params: fn(*leaves, *params), torch.bfloat16)
    theirs = step(cudnn, torch.bfloat16)
    exact = step(cudnn, torch.float64)
    flat = [list(outputs) + list(grads) for outputs, grads in (ours, theirs, exact)]
    for got, yardstick, want in zip(*flat, strict=True):
        assert rel_err(got, want) < 3 * rel_err(yardstick, want) + 1e-2


def copy_module(module, params):
    """A functional call of `module` with `params` (its flat weights) in their type."""
    def run(x, state):
        return torch.func.functional_call(module.to(params[0].dtype), dict(zip(module._flat_weights_names, params)),
                                          (x, state))
    return run


def _recurrence_graph(mode, hidden, proj, dtype, lengths):
    """rnn_recurrence and its backward as graph nodes (what as_function's graphs hold)."""
    gates = {"lstm": 4, "gru": 3}.get(mode, 1)
    state = proj or hidden
    g = dg.Graph(name=f"{mode}_{hidden}", io_data_type=dtype)
    xw = g.tensor(name="xw", dim=[5, 3, gates * hidden])
    h0, w_hh = g.tensor(name="h0", dim=[3, state]), g.tensor(name="w_hh", dim=[gates * hidden, state])
    c0 = g.tensor(name="c0", dim=[3, hidden]) if mode == "lstm" else None
    b_hh = g.tensor(name="b_hh", dim=[gates * hidden])
    w_hr = g.tensor(name="w_hr", dim=[proj, hidden]) if proj else None
    n = g.tensor(name="n", dim=[3], data_type=dg.int32) if lengths else None
    y, h_n, c_n, h_prev, c_prev, _ = g.rnn_recurrence(xw, h0, c0, w_hh, b_hh, w_hr, n, mode=mode, reverse=True)
    dy = g.tensor(name="dy", dim=[5, 3, state])
    grads = g.rnn_recurrence_backward(xw, w_hh, b_hh, w_hr, n, h_prev, c_prev, dy, h_n, c_n, mode=mode, reverse=True)
    for tensor in [y] + [t for t in grads if t is not None]:
        tensor.set_output(True)
    return g


def sm90_graphs():
    """Forward and backward recurrences under the GPU schedule (resident and streamed weights,
    projection, lengths, bf16 and fp32) for the sm_90 compile check."""
    real_schedule = rnn_lowering.schedule_rnn
    rnn_lowering.schedule_rnn = lambda geometry, interpreted, *rest: real_schedule(geometry, False, *rest)
    try:
        for mode, hidden, proj, dtype, lengths in (("lstm", 48, 0, dg.bfloat16, True), ("gru", 40, 0, dg.float32, False),
                                                   ("rnn_relu", 24, 0, dg.bfloat16, True),
                                                   ("lstm", 200, 72, dg.bfloat16, True), ("gru", 130, 0, dg.bfloat16, True)):
            g = _recurrence_graph(mode, hidden, proj, dtype, lengths)
            g.build()
            yield f"{mode} H={hidden} P={proj or hidden} {dtype.name}", g
    finally:
        rnn_lowering.schedule_rnn = real_schedule


def test_kernels_compile_for_sm90():
    # gru H=130 runs launches per step: forward 5 + 1, backward 10 + 1, each compiled
    assert "compiled 25 kernels for sm_90" in compiled_for_sm90("test_rnn:sm90_graphs", timeout=600)
