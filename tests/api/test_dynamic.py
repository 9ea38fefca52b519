"""Dynamic extents (dg.dynamic): a graph built once runs every size of its declared range, each
size against g.reference in float64 on poisoned outputs; a size seen before is a lookup, not a
build; each bucket's sizes share their kernels; out-of-range sizes and tensors that disagree on
a symbol raise ExecutionError and write nothing; symbols survive to_json/from_json and
propagate through the shape rules, and what cannot be symbolic yet is refused at the op call."""
import json

import pytest
import torch

import dnngraph as dg
from dnngraph.tensor import dense_strides, stride_order
from helpers import rel_err

TOL = 2e-5


def _poisoned(shape, stride=None):
    out = torch.empty(shape) if stride is None else torch.empty_strided(shape, stride)
    return out.fill_(float("nan"))


def _poisoned_for(handle, sizes: dict, device="cpu", dtype=torch.float32):
    """NaN memory for graph tensor `handle` at `sizes` (symbol name -> size), in its layout (dense
    in its axis order)."""
    dims = [sizes[d.name] if isinstance(d, dg.Dynamic) else d for d in handle.dynamic_dim]
    strides = dense_strides(dims, stride_order(handle.dim, handle.stride))
    return torch.empty_strided(dims, strides, dtype=dtype, device=device).fill_(float("nan"))


def _norm_graph():
    """relu -> rmsnorm over rows of a token axis; x stored transposed (a non-contiguous layout
    that stays dense at every size)."""
    tokens = dg.dynamic("tokens", 1, 64)
    g = dg.Graph(name="norm")
    x = g.tensor(name="x", dim=[tokens, 24], stride=[1, 64])  # column-major at every size
    scale = g.tensor(name="scale", dim=[1, 24])
    y, _ = g.rmsnorm(g.relu(x), scale, epsilon=1e-5)
    y.set_output(True)
    return g, x, scale, y


def _run_norm(g, x, scale, y, tokens):
    xt = torch.randn(24, tokens).t()  # strides (1, tokens)
    st = torch.randn(1, 24)
    out = _poisoned_for(y, {"tokens": tokens})
    assert out.stride() == (1, tokens)  # the output takes x's layout
    g.execute({x: xt, scale: st, y: out})
    return out, g.reference({x: xt, scale: st})[y.name]


def test_pointwise_and_norm_run_every_size_against_reference():
    g, x, scale, y = _norm_graph()
    assert y.dynamic_dim[0] == dg.dynamic("tokens", 1, 64) and y.dynamic_dim[1] == 24
    g.build()
    for tokens in (1, 5, 37, 64, 37):
        out, ref = _run_norm(g, x, scale, y, tokens)
        assert rel_err(out, ref) < TOL, tokens


def test_a_size_seen_before_builds_nothing_and_buckets_share_kernels():
    g, x, scale, y = _norm_graph()
    g.build()  # the plans at the ends of the range: 1 and 64
    built = g.plan.builds
    assert built == 2
    for tokens in (37, 50, 33):  # one bucket (33..64): one kernel source
        _run_norm(g, x, scale, y, tokens)
    assert g.plan.builds == built + 3
    for tokens in (37, 50, 33, 64):
        _run_norm(g, x, scale, y, tokens)
    assert g.plan.builds == built + 3  # seen before: found, not built
    kernels = g.plan.kernels_by_bucket()
    assert len(kernels[(64,)]) == 1, kernels
    assert "tokens" in g.explain()


def test_a_workspace_of_the_largest_size_serves_every_size():
    g, y = _llama_layer(dg.dynamic("seq", 1, 16), heads=2, kv_heads=1, dim=8, hidden=8, io_type=dg.float32)
    g.build()
    workspace = torch.empty(g.plan.workspace_size(), dtype=torch.uint8)
    assert workspace.numel() > 0  # values between kernels live there
    for s in (5, 16):
        inputs = {t.name: torch.randn(*[s if isinstance(d, dg.Dynamic) else d for d in t.dynamic_dim]) * 0.3
                  for t in g.inputs()}
        out = _poisoned_for(y, {"seq": s})
        g.execute({**inputs, y: out}, workspace=workspace)
        assert rel_err(out, g.reference(inputs)[y.name]) < 1e-4, s


def test_matmul_with_dynamic_rows_and_epilogue():
    rows = dg.dynamic("rows", 1, 80)
    g = dg.Graph(name="mm")
    a = g.tensor(name="a", dim=[rows, 24])
    w = g.tensor(name="w", dim=[24, 20])
    bias = g.tensor(name="bias", dim=[1, 20])
    y = g.relu(g.add(g.matmul(a, w), bias)).set_output(True)
    assert y.dynamic_dim[0].name == "rows"
    g.build()
    for m in (3, 37, 50, 80):
        at, wt, bt = torch.randn(m, 24), torch.randn(24, 20), torch.randn(1, 20)
        out = _poisoned((m, 20))
        g.execute({a: at, w: wt, bias: bt, y: out})
        assert rel_err(out, g.reference({a: at, w: wt, bias: bt})[y.name]) < TOL, m
    assert len(g.plan.kernels_by_bucket()[(64,)]) == 1  # 37 and 50 share one kernel


def _attention_graph(causal=True):
    seq = dg.dynamic("seq", 1, 48)
    g = dg.Graph(name="attention")
    q = g.tensor(name="q", dim=[2, 3, seq, 16])
    k = g.tensor(name="k", dim=[2, 3, seq, 16])
    v = g.tensor(name="v", dim=[2, 3, seq, 16])
    o, _ = g.sdpa(q, k, v, attn_scale=0.25, use_causal_mask=causal)
    o.set_output(True)
    return g, q, k, v, o


def test_sdpa_with_dynamic_sequence_length():
    g, q, k, v, o = _attention_graph()
    assert o.dynamic_dim[2].name == "seq"
    g.build()
    for s in (1, 7, 29, 48):
        qt, kt, vt = (torch.randn(2, 3, s, 16) for _ in range(3))
        out = _poisoned((2, 3, s, 16))
        g.execute({q: qt, k: kt, v: vt, o: out})
        assert rel_err(out, g.reference({q: qt, k: kt, v: vt})[o.name]) < TOL, s


def test_two_symbols_batch_and_sequence():
    batch, seq = dg.dynamic("batch", 1, 4), dg.dynamic("seq", 1, 40)
    g = dg.Graph(name="two")
    x = g.tensor(name="x", dim=[batch, seq, 16])
    w = g.tensor(name="w", dim=[1, 16, 8])
    y = g.gelu(g.matmul(x, w)).set_output(True)
    total = g.reduction(y, "sum", axes=[1]).set_output(True)  # over the dynamic axis: 1 stays
    assert y.dynamic_dim[:2] == (batch, seq) and total.dynamic_dim[1] == 1
    g.build()
    for b, s in ((1, 1), (3, 17), (4, 40), (2, 9)):
        xt, wt = torch.randn(b, s, 16), torch.randn(1, 16, 8)
        out, summed = _poisoned((b, s, 8)), _poisoned((b, 1, 8))
        g.execute({x: xt, w: wt, y: out, total: summed})
        ref = g.reference({"x": xt, "w": wt})
        assert rel_err(out, ref[y.name]) < TOL and rel_err(summed, ref[total.name]) < TOL, (b, s)


def test_out_of_range_and_disagreeing_symbols_write_nothing():
    g, q, k, v, o = _attention_graph(causal=False)
    g.build()
    for sizes in ((49, 49), (0, 0), (7, 9)):  # past the max, below the min, q and k disagree
        qt = torch.randn(2, 3, sizes[0], 16)
        kt = vt = torch.randn(2, 3, sizes[1], 16)
        out = _poisoned((2, 3, sizes[0], 16))
        with pytest.raises(dg.ExecutionError, match="seq"):
            g.execute({q: qt, k: kt, v: vt, o: out})
        assert torch.isnan(out).all()
    with pytest.raises(dg.ExecutionError, match="seq"):
        g.reference({q: torch.randn(2, 3, 5, 16), k: torch.randn(2, 3, 6, 16), v: torch.randn(2, 3, 6, 16)})
    with pytest.raises(dg.ExecutionError):  # a dynamic axis the value does not have
        g.execute({q: torch.randn(2, 3), k: torch.randn(2, 3, 5, 16), v: torch.randn(2, 3, 5, 16),
                   o: _poisoned((2, 3, 5, 16))})


def test_json_round_trip_keeps_symbols_and_runs():
    g, x, scale, y = _norm_graph()
    text = g.to_json()
    assert json.loads(text)["symbols"] == {"tokens": [1, 64]} and json.loads(text)["version"] == 2
    loaded = dg.Graph.from_json(text)
    assert loaded.to_json() == text
    lx, ly = loaded.tensor_by_name("x"), loaded.tensor_by_name(y.name)
    assert lx.dynamic_dim[0] == dg.dynamic("tokens", 1, 64) and ly.dynamic_dim[0].name == "tokens"
    loaded.build()
    for tokens in (3, 41):
        out, ref = _run_norm(loaded, lx, loaded.tensor_by_name("scale"), ly, tokens)
        assert rel_err(out, ref) < TOL
    document = json.loads(text)
    document["tensors"][0]["dynamic"] = ["nobody", None]
    with pytest.raises(dg.SerializationError, match="dynamic"):
        dg.Graph.from_json(json.dumps(document))
    document = json.loads(text)
    document["symbols"]["tokens"] = [5, 2]
    with pytest.raises(dg.SerializationError, match="tokens"):
        dg.Graph.from_json(json.dumps(document))


def test_static_graph_document_has_no_symbols():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[3, 4])
    g.relu(x).set_output(True)
    document = json.loads(g.to_json())
    assert "symbols" not in document and all("dynamic" not in t for t in document["tensors"])
    assert document["version"] == 1  # static documents read as before


def test_as_function_with_dynamic_inputs():
    g, x, scale, y = _norm_graph()
    fn = g.as_function()
    for tokens in (2, 19, 64, 19):
        xt, st = torch.randn(tokens, 24), torch.randn(1, 24)  # contiguous: the function lays it out
        got = fn(xt, st)
        assert got.shape == (tokens, 24)
        assert rel_err(got, g.reference({x: xt, scale: st})[y.name]) < TOL
    assert len(fn._functions) == 3
    with pytest.raises(dg.ExecutionError, match="tokens"):
        fn(torch.randn(65, 24), torch.randn(1, 24))


def test_as_function_is_differentiable_at_each_size():
    rows = dg.dynamic("rows", 2, 32)
    g = dg.Graph(name="grad")
    a = g.tensor(name="a", dim=[rows, 8])
    w = g.tensor(name="w", dim=[8, 6])
    g.tanh(g.matmul(a, w)).set_output(True)
    fn = g.as_function()
    for m in (2, 11):
        at, wt = torch.randn(m, 8, requires_grad=True), torch.randn(8, 6, requires_grad=True)
        fn(at, wt).sum().backward()
        ref_a, ref_w = at.detach().double().requires_grad_(), wt.detach().double().requires_grad_()
        torch.tanh(ref_a @ ref_w).sum().backward()
        assert rel_err(at.grad, ref_a.grad) < TOL and rel_err(wt.grad, ref_w.grad) < TOL


def test_what_cannot_be_symbolic_is_refused_at_the_op():
    tokens = dg.dynamic("tokens", 1, 64)
    g = dg.Graph()
    x = g.tensor(name="x", dim=[tokens, 8])
    with pytest.raises(dg.UnsupportedError, match="reshape"):
        g.reshape(x, [64 * 8])  # literal sizes over a dynamic axis
    with pytest.raises(dg.UnsupportedError, match="concatenate"):
        g.concatenate([x, g.tensor(name="four", dim=[4, 8])], axis=0)  # an axis of tokens + 4
    other = g.tensor(name="other", dim=[dg.dynamic("rows", 1, 64), 8])
    with pytest.raises(dg.UnsupportedError, match="tokens|rows"):
        g.add(x, other)  # two symbols forced equal
    with pytest.raises(dg.ValidationError, match="range"):
        g.tensor(name="again", dim=[dg.dynamic("tokens", 1, 32)])
    with pytest.raises(dg.UnsupportedError, match="dense"):
        g.tensor(name="padded", dim=[tokens, 8], stride=[16, 1])
    with pytest.raises(dg.ValidationError):
        dg.dynamic("tokens", 0, 8)
    with pytest.raises(dg.ValidationError):
        dg.dynamic("two words", 1, 8)
    assert [t.name for t in g.tensors] == ["x", "four", "other"]  # refused calls added nothing


def test_a_rule_that_fails_inside_the_range_is_refused_at_the_op():
    tokens = dg.dynamic("tokens", 1, 64)
    g = dg.Graph()
    x = g.tensor(name="x", dim=[tokens, 8])
    with pytest.raises(dg.UnsupportedError, match="slice"):
        g.slice(x, [(0, 40), (0, 8)])  # needs at least 40 tokens: the rule fails at the min
    y = g.slice(g.tensor(name="long", dim=[dg.dynamic("long", 40, 64), 8]), [(0, 40), (0, 8)])
    assert y.dynamic_dim == (40, 8)  # 40 rows at every size of 40..64


def _llama_layer(seq, heads, kv_heads, dim, hidden, io_type):
    """A Llama-like layer over one sequence of `seq` tokens, x [1, 1, seq, dim]: rmsnorm, per-head
    q/k/v projections ([1, heads, dim, head] weights), causal GQA attention, per-head output
    projection summed over heads, residual, rmsnorm, SwiGLU MLP, residual."""
    head = dim // heads
    g = dg.Graph(name="llama", io_data_type=io_type)
    x = g.tensor(name="x", dim=[1, 1, seq, dim])
    weights = {name: g.tensor(name=name, dim=dims) for name, dims in (
        ("norm1", [1, 1, 1, dim]), ("wq", [1, heads, dim, head]), ("wk", [1, kv_heads, dim, head]),
        ("wv", [1, kv_heads, dim, head]), ("wo", [1, heads, head, dim]), ("norm2", [1, 1, 1, dim]),
        ("w_gate", [1, 1, dim, hidden]), ("w_up", [1, 1, dim, hidden]), ("w_down", [1, 1, hidden, dim]))}
    h, _ = g.rmsnorm(x, weights["norm1"], norm_forward_phase="inference")
    q, k, v = (g.matmul(h, weights[name]) for name in ("wq", "wk", "wv"))  # [1, heads, seq, head]
    o, _ = g.sdpa(q, k, v, attn_scale=head ** -0.5, use_causal_mask=True)
    attended = g.reduction(g.matmul(o, weights["wo"]), "sum", axes=[1])  # [1, 1, seq, dim]
    r = g.add(x, attended)
    h2, _ = g.rmsnorm(r, weights["norm2"], norm_forward_phase="inference")
    mlp = g.mul(g.silu(g.matmul(h2, weights["w_gate"])), g.matmul(h2, weights["w_up"]))
    y = g.add(r, g.matmul(mlp, weights["w_down"])).set_output(True)
    return g, y


def _run_layer(g, y, s, device, torch_type, tolerance):
    inputs = {t.name: (torch.randn(*[s if isinstance(d, dg.Dynamic) else d for d in t.dynamic_dim]) * 0.3)
              .to(device=device, dtype=torch_type) for t in g.inputs()}
    out = _poisoned_for(y, {"seq": s}, device, torch_type)
    g.execute({**inputs, y: out})
    assert rel_err(out, g.reference(inputs)[y.name]) < tolerance, s


def test_llama_like_layer_at_three_sequence_lengths():
    g, y = _llama_layer(dg.dynamic("seq", 1, 24), heads=2, kv_heads=1, dim=16, hidden=24, io_type=dg.float32)
    g.build()
    for s in (3, 13, 24, 11):
        _run_layer(g, y, s, "cpu", torch.float32, 1e-4)
    assert g.plan.builds == 2 + 3  # the ends of the range at build, then 3, 13 and 11 (24 is the max)
    names = [[launch.kernel.__name__ for launch in g.plan.plan_for((s,)).launches] for s in (13, 11)]
    assert names[0] == names[1]  # one bucket: the same kernels


@pytest.mark.gpu
def test_llama_like_layer_three_sequence_lengths_one_build_gpu():
    g, y = _llama_layer(dg.dynamic("seq", 1, 4096), heads=8, kv_heads=2, dim=512, hidden=1024,
                        io_type=dg.bfloat16)
    g.build()
    for s in (1000, 777, 4095):  # 1000 and 777 share the bucket of 1024
        _run_layer(g, y, s, "cuda", torch.bfloat16, 2e-2)
    assert g.plan.builds == 2 + 3  # the ends of the range, then one build per new size
    names = [[launch.kernel.__name__ for launch in g.plan.plan_for((s,)).launches] for s in (1000, 777)]
    assert names[0] == names[1]  # the same kernels (compiled once) for both sizes of the bucket


def test_as_function_traces_once_under_torch_compile_dynamic():
    """torch.compile(fullgraph=True, dynamic=True) over a dynamic graph's function: one custom op
    whose outputs take their sizes from the inputs, so one dynamo graph serves every size."""
    from torch._dynamo.utils import counters

    rows = dg.dynamic("rows", 1, 64)
    g = dg.Graph(name="traced")
    a = g.tensor(name="a", dim=[rows, 8])
    w = g.tensor(name="w", dim=[8, 6])
    g.tanh(g.matmul(a, w)).set_output(True)
    fn = g.as_function()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x, y: fn(x, y) * 2, fullgraph=True, dynamic=True)
    for m in (3, 7, 9):
        x, wt = torch.randn(m, 8), torch.randn(8, 6)
        got = compiled(x, wt)
        assert got.shape == (m, 6)
        assert rel_err(got, torch.tanh(x.double() @ wt.double()) * 2) < TOL, m
    assert counters["stats"]["unique_graphs"] == 1
    with pytest.raises(dg.ExecutionError, match="rows"):  # the range is checked when the op runs
        compiled(torch.randn(65, 8), torch.randn(8, 6))



def test_as_function_differentiates_under_torch_compile_dynamic():
    """With gradients the traced call is differentiable: its backward op runs the derivation of
    the arguments' sizes; one dynamo graph (AOTAutograd's one symbolic trace) for every size,
    an input that wants no gradient gets none, and integer inputs never do."""
    from torch._dynamo.utils import counters

    rows = dg.dynamic("rows", 1, 64)
    g = dg.Graph(name="traced_grad")
    a = g.tensor(name="a", dim=[rows, 8], stride=[1, 64])  # column-major at every size
    w = g.tensor(name="w", dim=[8, 6])
    g.tanh(g.matmul(a, w)).set_output(True)
    g.reduction(a, "sum", [1]).set_output(True)
    fn = g.as_function()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x, y: fn(x, y), fullgraph=True, dynamic=True, backend="aot_eager")

    def check(m, weight_grad):
        x = torch.randn(8, m).t().requires_grad_()
        wt = (torch.randn(8, 6) / 3).requires_grad_(weight_grad)
        product, total = compiled(x, wt)
        seed_product, seed_total = torch.randn(m, 6), torch.randn(m, 1)
        ((product * seed_product).sum() + (total * seed_total).sum()).backward()
        ref_x, ref_w = x.detach().double().requires_grad_(), wt.detach().double().requires_grad_()
        ((torch.tanh(ref_x @ ref_w) * seed_product.double()).sum()
         + (ref_x.sum(1, keepdim=True) * seed_total.double()).sum()).backward()
        assert rel_err(x.grad, ref_x.grad) < TOL, m
        assert (wt.grad is not None) == weight_grad
        if weight_grad:
            assert rel_err(wt.grad, ref_w.grad) < TOL, m

    for m in (3, 64):
        check(m, True)
    assert counters["stats"]["unique_graphs"] == 1
    check(1, True)  # dynamo specializes a size of 1: a graph of its own
    check(9, False)  # and guards requires_grad: a graph whose backward skips w


def _relu_graph(tokens):
    g = dg.Graph(name="relu_rows")
    x = g.tensor(name="x", dim=[tokens, 3])
    y = g.relu(x).set_output(True)
    return g, x, y


def test_plans_kept_per_size_are_bounded_and_a_dropped_size_runs_again(monkeypatch):
    """A sweep over many sizes keeps at most PLANS_KEPT plans (a user running every length of
    8192 would otherwise hold 8192 plans forever); a size dropped is built again, correctly."""
    from dnngraph.runtime import dynamic_plan

    monkeypatch.setattr(dynamic_plan, "PLANS_KEPT", 3)
    g, x, y = _relu_graph(dg.dynamic("tokens", 1, 8192))
    g.build()
    fn = g.as_function()
    for tokens in (5, 6, 7, 8, 9, 5):
        xt = torch.randn(tokens, 3)
        out = _poisoned((tokens, 3))
        g.execute({x: xt, y: out})
        assert torch.equal(out, torch.relu(xt)), tokens
        assert torch.equal(fn(xt), torch.relu(xt)), tokens
        assert len(g.plan.sizes_built) <= 3 and len(fn._functions) <= 3
    assert (5,) in g.plan.sizes_built  # the most recently used sizes stay


def test_two_threads_executing_new_sizes_at_once():
    import threading

    g, x, y = _relu_graph(dg.dynamic("tokens", 1, 64))
    g.build()
    failures, barrier = [], threading.Barrier(4)

    def run(tokens):
        barrier.wait()
        for _ in range(3):
            xt = torch.randn(tokens, 3)
            out = _poisoned((tokens, 3))
            g.execute({x: xt, y: out})
            if not torch.equal(out, torch.relu(xt)):
                failures.append(tokens)

    threads = [threading.Thread(target=run, args=(tokens,)) for tokens in (3, 17, 31, 17)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert sorted(g.plan.sizes_built) == [(1,), (3,), (17,), (31,), (64,)]



def test_workspace_size_bounds_every_size_of_the_range():
    """The optional scratch a config choice adds (split-K partials) is not monotone in the size:
    fewer rows can mean more splits. workspace_size() promises the most any size needs, so a
    workspace of that size must serve every size: 2048 rows split K more than 3000 rows do."""
    rows = dg.dynamic("rows", 1, 3000)
    g = dg.Graph(name="splitk")
    x = g.tensor(name="x", dim=[rows, 8192])
    w = g.tensor(name="w", dim=[8192, 64])
    g.relu(g.matmul(x, w)).set_output(True)
    g.build()
    bound = g.plan.workspace_size()
    for size in (1, 700, 2048, 2100, 3000):
        assert g.plan.workspace_size(sizes=(size,)) <= bound, size


def test_sizes_under_the_workspace_bound_keep_their_split_k():
    """The bound cuts scratch only where a size needs more than the largest: a single row with a
    long K still splits K (as a static graph of that size does)."""
    rows = dg.dynamic("rows", 1, 4096)
    g = dg.Graph(name="decode")
    x = g.tensor(name="x", dim=[rows, 8192])
    w = g.tensor(name="w", dim=[8192, 64])
    g.relu(g.matmul(x, w)).set_output(True)
    g.build()
    static = g.specialised({"rows": 1}).build()
    assert g.plan.workspace_size(sizes=(1,)) == static.plan.workspace_size() > 0


def test_json_refuses_symbols_its_version_or_dims_cannot_hold():
    """A version-1 document has no symbols (a version-1 reader would run it at the max size), and
    a dynamic axis is recorded at its symbol's max: a document saying otherwise is malformed."""
    g, *_ = _norm_graph()
    document = json.loads(g.to_json())
    as_version_1 = {**document, "version": 1}
    with pytest.raises(dg.SerializationError, match="version"):
        dg.Graph.from_json(json.dumps(as_version_1))
    without_symbols = {key: value for key, value in as_version_1.items() if key != "symbols"}
    with pytest.raises(dg.SerializationError, match="version"):  # the marks alone are version 2 too
        dg.Graph.from_json(json.dumps(without_symbols))
    other_dims = json.loads(g.to_json())
    record = next(r for r in other_dims["tensors"] if r["name"] == "x")
    record["dim"], record["stride"] = [10, 24], [1, 10]  # tokens at 10, not its max 64
    with pytest.raises(dg.SerializationError, match="tokens"):
        dg.Graph.from_json(json.dumps(other_dims))


def test_slices_whose_rows_do_not_follow_the_symbol_are_refused_at_the_op():
    """The last 3 rows at 64 tokens (61:64, absolute once normalized) do not exist at 2 tokens;
    every other row is ceil(tokens / 2) rows: neither static nor the symbol."""
    tokens = dg.dynamic("tokens", 2, 64)
    g = dg.Graph()
    x = g.tensor(name="x", dim=[tokens, 8])
    with pytest.raises(dg.UnsupportedError, match="slice"):
        g.slice(x, [slice(-3, None), slice(0, 8)])
    with pytest.raises(dg.UnsupportedError, match="slice"):
        g.slice(x, [slice(0, None, 2), slice(0, 8)])  # ceil(tokens / 2) rows
    assert [t.name for t in g.tensors] == ["x"]


def test_a_graph_at_some_size_whose_dims_disagree_with_its_symbols_runs_nothing():
    """The safety net behind the probes: a graph at given sizes whose tensors are not the
    dynamic graph's dims with each symbol at its size is refused before anything runs."""
    g, x, scale, y = _norm_graph()
    sized = g.specialised({"tokens": 5})
    assert sized.tensor_by_name(y.name).dim == (5, 24)
    y._dynamic = (None, None)  # as if a rule had let a moving axis pass as static
    with pytest.raises(dg.ValidationError, match="tokens"):
        g.specialised({"tokens": 5})


def test_plan_at_index_of_a_dynamic_graph_runs_every_size():
    """build_plan_at_index / execute_plan_at_index (the frontend's plan list) over a dynamic
    graph build per size as build() does, not one static plan at the largest sizes."""
    g, x, scale, y = _norm_graph()
    assert g.get_execution_plan_count() >= 1
    g.build_plan_at_index(0)
    for tokens in (1, 9):
        xt, st = torch.randn(24, tokens).t(), torch.randn(1, 24)
        out = _poisoned_for(y, {"tokens": tokens})
        g.execute_plan_at_index({x: xt, scale: st, y: out}, 0)
        assert rel_err(out, g.reference({x: xt, scale: st})[y.name]) < TOL, tokens


def test_set_stride_of_a_dynamic_tensor_keeps_it_dense():
    """A padded layout set after declaration was dropped silently (every size is built dense):
    refused as at declaration; a dense permutation is taken."""
    g = dg.Graph()
    x = g.tensor(name="x", dim=[dg.dynamic("tokens", 1, 16), 8])
    with pytest.raises(dg.UnsupportedError, match="dense"):
        x.set_stride([16, 1])
    assert x.stride == (8, 1)
    assert x.set_stride([1, 16]).stride == (1, 16)  # column-major: dense at every size


def test_sizes_of_a_dynamic_graph_share_one_workspace_per_stream():
    """Each size's plan kept a workspace of its own per stream: up to PLANS_KEPT buffers for one
    graph. Every size fits the workspace of the largest sizes, so they share one."""
    g, y = _llama_layer(dg.dynamic("seq", 1, 16), heads=2, kv_heads=1, dim=8, hidden=8, io_type=dg.float32)
    g.build()
    for s in (5, 16, 9, 5):
        _run_layer(g, y, s, "cpu", torch.float32, 1e-4)
    buffers = {workspace.buffer.data_ptr() for key in g.plan.sizes_built
               for workspace in g.plan.plan_for(key)._streams.values()}
    assert len(buffers) == 1
    assert next(iter(g.plan.plan_for((5,))._streams.values())).buffer.numel() == g.plan.workspace_size()


@pytest.mark.gpu
def test_two_streams_and_threads_at_different_sizes_share_the_workspace_safely_gpu():
    """Sizes share one workspace per stream: two threads on one stream and a third on its own
    stream, each at sizes of its own, every result against the reference."""
    import threading

    rows = dg.dynamic("rows", 1, 2048)
    g = dg.Graph(name="streams", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[rows, 1024])
    w = g.tensor(name="w", dim=[1024, 256])
    y = g.relu(g.matmul(x, w)).set_output(True)
    total = g.reduction(y, "sum", axes=[0]).set_output(True)
    g.build()
    wt = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    failures, side = [], torch.cuda.Stream()

    def run(sizes, stream):
        with torch.cuda.stream(stream):
            for m in sizes:
                xt = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
                out = torch.full((m, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
                summed = torch.full((1, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
                g.execute({x: xt, w: wt, y: out, total: summed})
                stream.synchronize()
                ref = g.reference({x: xt, w: wt})
                if rel_err(out, ref[y.name]) > 2e-2 or rel_err(summed, ref[total.name]) > 2e-2:
                    failures.append(m)

    default = torch.cuda.current_stream()
    threads = [threading.Thread(target=run, args=(sizes, stream)) for sizes, stream in
               (((7, 1500, 33), default), ((2048, 5, 700), default), ((1, 999, 2047), side))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_a_workspace_too_small_for_the_size_is_refused_and_writes_nothing():
    g, y = _llama_layer(dg.dynamic("seq", 1, 16), heads=2, kv_heads=1, dim=8, hidden=8, io_type=dg.float32)
    g.build()
    small = torch.empty(g.plan.workspace_size(sizes=(3,)), dtype=torch.uint8)
    assert small.numel() < g.plan.workspace_size(sizes=(16,))
    inputs = {t.name: torch.randn(*[16 if isinstance(d, dg.Dynamic) else d for d in t.dynamic_dim])
              for t in g.inputs()}
    out = _poisoned_for(y, {"seq": 16})
    with pytest.raises(dg.ExecutionError, match="workspace"):
        g.execute({**inputs, y: out}, workspace=small)
    assert torch.isnan(out).all()


def _softmax_and_sum_along(s):
    g = dg.Graph(name="along")
    x = g.tensor(name="x", dim=[3, s])
    g.softmax(x, axis=1).set_output(True)
    g.reduction(g.exp(x), "max", [1]).set_output(True)
    return g


def _layernorm_over(s):
    g = dg.Graph(name="layernorm")
    x = g.tensor(name="x", dim=[3, s])
    scale, bias = g.tensor(name="scale", dim=[1, s]), g.tensor(name="bias", dim=[1, s])
    y, mean, inv_variance = g.layernorm(x, scale, bias)
    for out in (y, mean, inv_variance):
        out.set_output(True)
    return g


def _conv_pool_batch(s):
    g = dg.Graph(name="conv")
    x = g.tensor(name="x", dim=[s, 3, 7, 7])
    w = g.tensor(name="w", dim=[4, 3, 3, 3])
    y = g.relu(g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1]))
    g.pooling(y, mode="avg_exclude_pad", window=[2, 2], stride=[2, 2], padding=[1, 1]).set_output(True)
    return g


def _matmul_dynamic_k(s):
    g = dg.Graph(name="k")
    a, b = g.tensor(name="a", dim=[5, s]), g.tensor(name="b", dim=[s, 7])
    g.matmul(a, b).set_output(True)
    return g


def _transposed_and_broadcast(s):
    g = dg.Graph(name="t")
    x = g.tensor(name="x", dim=[s, 6])
    row = g.tensor(name="row", dim=[1, 6])
    g.transpose(g.mul(x, row), [1, 0]).set_output(True)  # [6, s]: the dynamic axis moved inner
    return g


@pytest.mark.parametrize("make", [_softmax_and_sum_along, _layernorm_over, _conv_pool_batch, _matmul_dynamic_k,
                                  _transposed_and_broadcast])
def test_each_family_at_the_min_odd_sizes_tile_multiples_and_the_max(make):
    g = make(dg.dynamic("s", 1, 40))
    g.build()
    for size in (1, 17, 32, 40, 1):
        inputs = {t.name: torch.randn(*[size if isinstance(d, dg.Dynamic) else d for d in t.dynamic_dim])
                  for t in g.inputs()}
        outs = {t.name: _poisoned_for(t, {"s": size}) for t in g.outputs()}
        g.execute({**inputs, **outs})
        ref = g.reference(inputs)
        for name, out in outs.items():
            assert rel_err(out, ref[name]) < TOL, (size, name)


@pytest.mark.gpu
def test_one_workspace_of_workspace_size_serves_split_k_sizes_gpu():
    rows = dg.dynamic("rows", 1, 3000)
    g = dg.Graph(name="splitk", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[rows, 8192])
    w = g.tensor(name="w", dim=[8192, 64])
    y = g.relu(g.matmul(x, w)).set_output(True)
    g.build()
    workspace = torch.empty(g.plan.workspace_size(), dtype=torch.uint8, device="cuda")
    wt = torch.randn(8192, 64, device="cuda", dtype=torch.bfloat16)
    for size in (1, 700, 1024, 2048, 2100, 3000):
        assert g.plan.workspace_size(sizes=(size,)) <= workspace.numel(), size
        xt = torch.randn(size, 8192, device="cuda", dtype=torch.bfloat16)
        out = torch.full((size, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
        g.execute({x: xt, w: wt, y: out}, workspace=workspace)
        assert rel_err(out, g.reference({x: xt, w: wt})[y.name]) < 2e-2, size


# --- one compile per bucket on a GPU target: configs chosen at the bucket's top ----------------
# Plans for the H200 are built here without one (nothing runs): the heuristics pick tiles,
# split-K and kernel kinds from the sizes, so every size of a bucket must be planned as its top is,
# while the kernels take the exact sizes as runtime arguments.

def _compiled_as(launch) -> tuple:
    """What Triton compiles a launch into, beyond the integers it specializes by value: the
    kernel (named by its source's content), its constexprs, warps and stages."""
    constexprs = tuple((a.name, a.value) for a in launch.arguments if a.kind == "constexpr")
    return launch.kernel.__name__, constexprs, launch.num_warps, launch.num_stages


def _compiles_by_bucket(g, buckets) -> dict:
    """Per bucket (its sizes, one symbol), the distinct launch lists its sizes' plans compile;
    one per bucket is the promise."""
    found = {}
    for sizes in buckets:
        found[sizes] = {tuple(_compiled_as(launch) for launch in g.plan.plan_for((s,)).launches) for s in sizes}
    return found


def _one_compile_per_bucket(g, buckets):
    found = _compiles_by_bucket(g, buckets)
    for sizes, compiled in found.items():
        assert len(compiled) == 1, (sizes, [sorted(set(a) ^ set(b)) for a in compiled for b in compiled if a != b][:1])
    return {sizes: next(iter(compiled)) for sizes, compiled in found.items()}


TOKEN_BUCKETS = ((3, 4), (5, 7, 8), (9, 13, 16), (17, 24, 31), (33, 48, 64), (65, 100, 128), (129, 200, 256),
                 (257, 400, 512), (513, 777, 1000, 1024), (2049, 3000, 4095, 4096))


def test_llama_like_layer_planned_for_the_h200_compiles_once_per_bucket():
    """The GPU test's layer (rmsnorm, projections, causal GQA sdpa, a reduction over heads,
    SwiGLU matmuls with epilogues): the H200's heuristics change tiles, kernel kinds (small-M,
    split-K) and row configs with the token count, but every size of a bucket gets its top's."""
    g, _ = _llama_layer(dg.dynamic("seq", 1, 4096), heads=8, kv_heads=2, dim=512, hidden=1024,
                        io_type=dg.bfloat16)
    g.build(options=dg.BuildOptions(target=dg.target.H200))
    per_bucket = _one_compile_per_bucket(g, TOKEN_BUCKETS)
    # the test has teeth: the choices do change between buckets, family by family
    names = lambda launches: {name.split("_")[1] for name, *_ in launches}
    assert {"norm", "matmul", "sdpa", "reduction"} <= names(per_bucket[(3, 4)])
    assert len(set(per_bucket.values())) > 3


def _matmul_graph(rows, n, k, epilogue=True):
    g = dg.Graph(name="mm", io_data_type=dg.bfloat16)
    a = g.tensor(name="a", dim=[rows, k])
    b = g.tensor(name="b", dim=[k, n])
    c = g.matmul(a, b)
    if epilogue:
        c = g.silu(g.add(c, g.tensor(name="bias", dim=[1, n])))
    c.set_output(True).set_name("c")
    return g


@pytest.mark.parametrize("n, k", [(128, 16384), (11008, 4096), (4096, 4096)], ids=["split-k", "decode", "square"])
def test_matmul_planned_for_the_h200_compiles_once_per_bucket(n, k):
    """Split-K at a small M, the small-M kernel at a few rows, tiled or persistent ones at many:
    the kernel kind changes across buckets, never inside one."""
    g = _matmul_graph(dg.dynamic("rows", 1, 4096), n, k)
    g.build(options=dg.BuildOptions(target=dg.target.H200))
    per_bucket = _one_compile_per_bucket(g, ((1,), (2,)) + TOKEN_BUCKETS)
    kinds = {g.plan.plan_for((sizes[0],)).launches[0].config_text.split()[0] for sizes in per_bucket}
    assert len(kinds) > 1, kinds


def test_pointwise_and_softmax_over_a_dynamic_axis_planned_for_the_h200_compile_once_per_bucket():
    """A pointwise chain over [tokens, 4096], and a softmax along the dynamic axis (its row
    length varies in a bucket: one tile per row only where the top's rows fit one)."""
    tokens = dg.dynamic("tokens", 1, 8192)
    g = dg.Graph(name="rows", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[tokens, 4096])
    y = g.tensor(name="y", dim=[1, 4096])
    g.gelu(g.mul(x, y)).set_output(True).set_name("pointwise")
    scores = g.tensor(name="scores", dim=[16, tokens])
    g.softmax(scores, axis=-1).set_output(True).set_name("softmax")
    g.build(options=dg.BuildOptions(target=dg.target.H200))
    _one_compile_per_bucket(g, TOKEN_BUCKETS + ((4097, 6000, 8192),))


def test_configs_chosen_at_a_buckets_top_run_right_at_its_every_size():
    """The interpreter's target plans as the H100: split-K chosen for 128 rows also runs 65
    rows, the bucket's low end, right; a softmax whose row is one tile at the top runs shorter
    rows; each against the float64 reference on poisoned outputs, with the bucket's one config."""
    g = _matmul_graph(dg.dynamic("rows", 1, 128), 64, 2048, epilogue=False)
    g.build()
    texts = {s: [launch.config_text for launch in g.plan.plan_for((s,)).launches] for s in (65, 97, 128)}
    assert texts[65][0].split()[0] == "split_k" and len({tuple(_compiled_as(launch) for launch in
                                                         g.plan.plan_for((s,)).launches) for s in texts}) == 1
    for s in (65, 97):
        a, b = torch.randn(s, 2048).bfloat16(), torch.randn(2048, 64).bfloat16()
        out = _poisoned((s, 64)).bfloat16()
        g.execute({"a": a, "b": b, "c": out})
        assert rel_err(out.float(), g.reference({"a": a, "b": b})["c"]) < 1e-2, s


@pytest.mark.parametrize("layout", ["row", "column"])
def test_matmul_of_a_dynamic_transposed_operand_planned_for_the_h200_compiles_once_per_bucket(layout):
    """A column-major A of dynamic rows: its pitch is the row count, so descriptor (TMA)
    legality and the contiguity hints along M hold at some sizes of a bucket only; neither may
    split a bucket in two."""
    rows = dg.dynamic("rows", 1, 4096)
    g = dg.Graph(name="mm_t", io_data_type=dg.bfloat16)
    a = g.tensor(name="a", dim=[rows, 1024], stride=[1, 4096] if layout == "column" else None)
    b = g.tensor(name="b", dim=[1024, 2048])
    g.matmul(a, b).set_output(True).set_name("c")
    g.build(options=dg.BuildOptions(target=dg.target.H200))
    _one_compile_per_bucket(g, TOKEN_BUCKETS)


def _conv_batch(n):
    """A 3x3 conv (implicit GEMM) and a 1x1 conv (posed as a matmul: hints along M) of NHWC x."""
    g = dg.Graph(name="conv", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[n, 64, 14, 14], stride=[14 * 14 * 64, 1, 14 * 64, 64])
    w, w1 = g.tensor(name="w", dim=[128, 64, 3, 3]), g.tensor(name="w1", dim=[96, 64, 1, 1])
    g.relu(g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1])).set_output(True)
    g.conv_fprop(x, w1, padding=[0, 0], stride=[1, 1], dilation=[1, 1]).set_output(True)
    return g


def _conv_wgrad_batch(n):
    """wgrad of a dynamic batch: it reduces over N x pixels (split-K)."""
    g = dg.Graph(name="conv_wgrad", io_data_type=dg.bfloat16)
    dy, x = g.tensor(name="dy", dim=[n, 128, 14, 14]), g.tensor(name="x", dim=[n, 64, 14, 14])
    g.conv_wgrad(dy, x, [128, 64, 3, 3], padding=[1, 1], stride=[1, 1], dilation=[1, 1]).set_output(True)
    return g


def _pooling_batch(n):
    g = dg.Graph(name="pool", io_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[n, 64, 28, 28])
    g.pooling(x, mode="max", window=[2, 2], stride=[2, 2], padding=[0, 0]).set_output(True)
    return g


def _decode_sdpa(s):
    g = dg.Graph(name="decode", io_data_type=dg.bfloat16)
    q = g.tensor(name="q", dim=[2, 8, 1, 64])
    k, v = (g.tensor(name=name, dim=[2, 2, s, 64]) for name in ("k", "v"))
    g.sdpa(q, k, v, attn_scale=0.125)[0].set_output(True)
    return g


def _layernorm_training(s):
    g = dg.Graph(name="ln", io_data_type=dg.bfloat16)
    x, dy = g.tensor(name="x", dim=[s, 4096]), g.tensor(name="dy", dim=[s, 4096])
    scale, bias = g.tensor(name="scale", dim=[1, 4096]), g.tensor(name="bias", dim=[1, 4096])
    _, mean, inv_variance = g.layernorm(x, scale, bias)
    for t in g.layernorm_backward(dy, x, scale, mean, inv_variance):
        if t is not None:
            t.set_output(True)
    return g


def _sdpa_training(s):
    g = dg.Graph(name="attn", io_data_type=dg.bfloat16)
    q, k, v, do = (g.tensor(name=name, dim=[1, 8, s, 64]) for name in ("q", "k", "v", "do"))
    o, stats = g.sdpa(q, k, v, attn_scale=0.125, is_inference=False, use_causal_mask=True)
    o.set_output(True)
    for t in g.sdpa_backward(q, k, v, o, do, stats, attn_scale=0.125, use_causal_mask=True):
        t.set_output(True)
    return g


@pytest.mark.parametrize("make, buckets", [
    (_sdpa_training, TOKEN_BUCKETS[:-1]),
    (_conv_batch, TOKEN_BUCKETS[:-1]),
    (_conv_wgrad_batch, TOKEN_BUCKETS[:-1]),
    (_pooling_batch, TOKEN_BUCKETS[:-1]),
    (_decode_sdpa, TOKEN_BUCKETS[:-1]),
    (_layernorm_training, TOKEN_BUCKETS[:-1]),
], ids=["sdpa training", "conv batch", "conv wgrad batch", "pooling batch", "sdpa decode kv", "layernorm training"])
def test_other_families_planned_for_the_h200_compile_once_per_bucket(make, buckets):
    g = make(dg.dynamic("s", 1, 1024))
    g.build(options=dg.BuildOptions(target=dg.target.H200))
    _one_compile_per_bucket(g, buckets)


def test_every_specialised_graph_chooses_at_its_buckets_top():
    """Graph.specialised (which as_function's per-size functions build from too, not only the
    graph's own plans) carries the bucket: static builds of sizes of one bucket compile alike."""
    from dnngraph.build import build_plan

    g = _matmul_graph(dg.dynamic("rows", 1, 4096), 11008, 4096)
    h200 = dg.BuildOptions(target=dg.target.H200)
    compiled = {tuple(_compiled_as(launch) for launch in build_plan(g.specialised({"rows": rows}), h200).launches)
                for rows in (9, 13, 16)}
    assert len(compiled) == 1
    assert g.specialised({"rows": 13}).bucket.top(g.tensor_by_name("a"))[0] == (16, 4096)
    fn = g.as_function(options=h200)
    assert fn._function_at((13,)).graph.bucket == g.specialised({"rows": 13}).bucket


def test_fused_norm_backward_with_programs_chosen_at_a_buckets_top_runs_right_at_its_low_end():
    """The fused layernorm backward's program count is chosen for the top's rows: at the low
    end of the bucket some programs find no rows and store zero partials, and dx, dscale and
    dbias still match the reference (poisoned outputs)."""
    g = dg.Graph(name="ln_train")
    rows = dg.dynamic("rows", 1, 128)
    x, dy = g.tensor(name="x", dim=[rows, 1024]), g.tensor(name="dy", dim=[rows, 1024])
    scale, bias = g.tensor(name="scale", dim=[1, 1024]), g.tensor(name="bias", dim=[1, 1024])
    _, mean, inv_variance = g.layernorm(x, scale, bias)
    grads = [t for t in g.layernorm_backward(dy, x, scale, mean, inv_variance) if t is not None]
    for index, grad in enumerate(grads):
        grad.set_output(True).set_name(f"grad{index}")
    g.build()
    for low, top in ((65, 128), (5, 8)):
        compiled = [tuple(_compiled_as(launch) for launch in g.plan.plan_for((s,)).launches) for s in (low, top)]
        assert compiled[0] == compiled[1] and any(name.startswith("dnngraph_norm") and "SPLITS" in dict(c)
                                                  for name, c, *_ in compiled[0])
        assert "fused" in " ".join(launch.config_text for launch in g.plan.plan_for((low,)).launches)
        inputs = {"x": torch.randn(low, 1024), "dy": torch.randn(low, 1024), "scale": torch.randn(1, 1024),
                  "bias": torch.randn(1, 1024)}
        reference = g.reference(inputs)
        outputs = {grad.name: torch.full(tuple(reference[grad.name].shape), float("nan")) for grad in grads}
        g.execute({**inputs, **outputs})
        for name, got in outputs.items():
            assert rel_err(got, reference[name]) < TOL, (low, name)


def test_decode_key_splits_chosen_at_a_buckets_top_run_right_at_its_low_end():
    """Decode attention splits the keys by the top's length (SPLITS and CHUNK are constexprs):
    at the bucket's low end the last splits see no key, and their empty partials weigh nothing
    in the combine."""
    g = dg.Graph(name="decode")
    q = g.tensor(name="q", dim=[1, 4, 1, 32])
    k, v = (g.tensor(name=name, dim=[1, 1, dg.dynamic("keys", 1, 512), 32]) for name in ("k", "v"))
    g.sdpa(q, k, v, attn_scale=0.2)[0].set_output(True).set_name("o")
    g.build()
    for low, top in ((257, 512), (129, 256)):
        compiled = [tuple(_compiled_as(launch) for launch in g.plan.plan_for((s,)).launches) for s in (low, top)]
        assert compiled[0] == compiled[1] and len(compiled[0]) == 2  # the split kernel and its combine
        inputs = {"q": torch.randn(1, 4, 1, 32), "k": torch.randn(1, 1, low, 32), "v": torch.randn(1, 1, low, 32)}
        out = _poisoned((1, 4, 1, 32))
        g.execute({**inputs, "o": out})
        assert rel_err(out, g.reference(inputs)["o"]) < TOL, low


def test_specialised_refuses_sizes_that_are_not_each_symbol_at_an_integer_in_range():
    tokens = dg.dynamic("tokens", 2, 64)
    g = dg.Graph(name="sized")
    x = g.tensor(name="x", dim=[tokens, 8])
    g.relu(x).set_output(True)
    assert g.specialised({"tokens": 17}).tensor_by_name("x").dim == (17, 8)
    for bad in (x, [17], {}, {"tokens": 17, "batch": 2}, {"tokens": 1}, {"tokens": 65}, {"tokens": 2.0},
                {"tokens": True}, {"other": 3}):
        with pytest.raises(dg.ValidationError, match="sizes are|takes an integer"):
            g.specialised(bad)
