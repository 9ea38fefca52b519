"""Graph.as_function: values and every input gradient against torch autograd through the graph's
float64 reference (op by op), per family; structure of the derived graphs; small training loops
against the same torch models."""
import math

import pytest
import torch

import dnngraph as dg
from dnngraph.autodiff import derive
from helpers import rel_err

GEN = torch.Generator().manual_seed(5)


def _randn(*dims, positive=False):
    value = torch.randn(*dims, generator=GEN)
    return value.abs() + 0.5 if positive else value


def _graph(inputs: dict):
    g = dg.Graph(name="fn")
    return g, {name: g.tensor_like(value, name) for name, value in inputs.items()}


def _reference_grads(g, fn, inputs: dict, grads_out):
    """Outputs and input gradients of the graph's float64 reference under torch autograd."""
    leaves = {n: v.double().requires_grad_(v.is_floating_point()) for n, v in inputs.items()}
    with torch.enable_grad():
        refs = g.reference(leaves)
        outs = [refs[t.name] for t in fn.outputs]
        wanted = [leaves[t.name] for t in fn.inputs if leaves[t.name].requires_grad]
        floats = [(o, gy.double()) for o, gy in zip(outs, grads_out) if o.is_floating_point()]
        grads = torch.autograd.grad([o for o, _ in floats], wanted, [gy for _, gy in floats], allow_unused=True)
    return outs, dict(zip([t.name for t in fn.inputs if leaves[t.name].requires_grad], grads))


def check_function(g, inputs: dict, tolerance=5e-5, outputs=None):
    """Run as_function forward and backward (poisoned .grad first) against the reference."""
    fn = g.as_function(outputs=outputs)
    args = [inputs[t.name].clone().requires_grad_(inputs[t.name].is_floating_point()) for t in fn.inputs]
    for arg in args:
        if arg.requires_grad:
            arg.grad = torch.full_like(arg, float("nan"))
            arg.grad = None
    results = fn(*args)
    results = results if isinstance(results, tuple) else (results,)
    grads_out = [torch.randn(r.shape, generator=GEN) if r.is_floating_point() else None for r in results]
    ref_outs, ref_grads = _reference_grads(g, fn, inputs, grads_out)
    for result, ref in zip(results, ref_outs):
        assert rel_err(result, ref) < tolerance
    torch.autograd.backward([r for r, gy in zip(results, grads_out) if gy is not None],
                            [gy for gy in grads_out if gy is not None])
    for tensor, arg in zip(fn.inputs, args):
        if not arg.requires_grad:
            continue
        ref = ref_grads[tensor.name]
        ref = torch.zeros_like(arg, dtype=torch.float64) if ref is None else ref
        assert arg.grad is not None and arg.grad.shape == arg.shape, tensor.name
        assert rel_err(arg.grad, ref) < tolerance, f"d{tensor.name}: {rel_err(arg.grad, ref)}"
    return fn


# --- pointwise ------------------------------------------------------------------------------------
UNARY = ["neg", "abs", "exp", "sin", "cos", "tanh", "sigmoid", "relu", "leaky_relu", "elu", "gelu",
         "gelu_tanh", "silu", "softplus", "erf", "floor"]
POSITIVE = ["log", "sqrt", "rsqrt", "reciprocal"]


@pytest.mark.parametrize("op", UNARY + POSITIVE)
def test_unary_ops(op):
    inputs = {"x": _randn(3, 7, positive=op in POSITIVE)}
    g, t = _graph(inputs)
    getattr(g, op)(t["x"]).set_output(True)
    check_function(g, inputs)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum", "minimum", "pow"])
def test_binary_ops_broadcast_and_constants(op):
    """b broadcasts over rows (its gradient is summed); a constant operand takes none."""
    inputs = {"a": _randn(4, 5, positive=op == "pow"), "b": _randn(1, 5, positive=op in ("div", "pow"))}
    if op in ("maximum", "minimum"):
        inputs["a"][0, :2] = inputs["b"][0, :2]  # ties split the gradient
    g, t = _graph(inputs)
    y = getattr(g, op)(t["a"], t["b"])
    getattr(g, op)(y, 1.5).set_output(True)
    check_function(g, inputs)


def test_pow_at_a_zero_base_or_exponent_follows_torch():
    """d(a^b)/db is 0 where a is 0 and b >= 0 (not 0 * log 0 = NaN), d(a^b)/da is 0 where b is 0;
    constant bases 0 and 2 included."""
    inputs = {"x": _randn(4, 5), "p": _randn(1, 5, positive=True), "q": _randn(4, 5)}
    inputs["q"][1, :3] = 0.0
    g, t = _graph(inputs)
    base = g.relu(t["x"])  # exact zeros
    g.add(g.pow(base, t["p"]), g.pow(g.exp(t["x"]), t["q"])).set_output(True)
    g.add(g.pow(0.0, t["p"]), g.pow(2.0, t["q"])).set_output(True)
    g.pow(t["x"], 0.0).set_output(True)
    check_function(g, inputs)


def test_where_and_a_value_read_twice():
    inputs = {"x": _randn(6, 3), "y": _randn(6, 3)}
    g, t = _graph(inputs)
    s = g.where(g.cmp_gt(t["x"], 0.0), g.mul(t["x"], t["y"]), t["y"])
    g.add(s, g.exp(t["x"])).set_output(True)
    check_function(g, inputs)


# --- anchors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sum", "mean", "max", "min", "amax", "norm1", "norm2", "prod"])
def test_reductions(mode):
    inputs = {"x": _randn(3, 5, 4, positive=mode == "prod")}
    g, t = _graph(inputs)
    g.reduction(g.mul(t["x"], 2.0), mode, [0, 2]).set_output(True)
    check_function(g, inputs)


@pytest.mark.parametrize("mode", ["max", "min", "amax"])
def test_extremes_of_an_fp16_graph_find_their_element(mode):
    """The forward's max is stored in fp16 while x (exp of the input, or a saved sum) is compared
    at float32 in the backward: dy must still reach the element that wins (it reached none)."""
    inputs = {"x": _randn(3, 6).half(), "w": _randn(3, 6).half()}
    g = dg.Graph(name="fn", io_data_type=dg.float16, intermediate_data_type=dg.float32)
    t = {name: g.tensor_like(value, name) for name, value in inputs.items()}
    g.reduction(g.exp(t["x"]), mode, [1]).set_output(True)
    g.reduction(g.reduction(t["w"], "sum", [1]), mode, [0]).set_output(True)
    check_function(g, inputs, tolerance=2e-3)


@pytest.mark.parametrize("log", [False, True])
def test_softmax(log):
    inputs = {"x": _randn(4, 9)}
    g, t = _graph(inputs)
    g.softmax(t["x"], axis=1, log=log).set_output(True)
    check_function(g, inputs)


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm", "groupnorm", "instancenorm", "batchnorm"])
def test_norms(op):
    inputs = {"x": _randn(4, 6, 5), "scale": _randn(1, 6, 1) if op in ("groupnorm", "instancenorm", "batchnorm")
              else _randn(1, 6, 5), "bias": _randn(1, 6, 1) if op in ("groupnorm", "instancenorm", "batchnorm")
              else _randn(1, 6, 5)}
    g, t = _graph(inputs)
    args = {"groups": 3} if op == "groupnorm" else {}
    y = getattr(g, op)(t["x"], t["scale"], t["bias"], **args)[0]
    g.mul(y, y).set_output(True)
    check_function(g, inputs, tolerance=2e-4)


def test_norm_in_inference_phase_trains_through_its_training_form():
    inputs = {"x": _randn(3, 8), "scale": _randn(1, 8), "bias": _randn(1, 8)}
    g, t = _graph(inputs)
    g.layernorm(t["x"], t["scale"], t["bias"], norm_forward_phase="inference")[0].set_output(True)
    check_function(g, inputs, tolerance=2e-4)


def test_matmul_with_broadcast_batch_and_transposed_operand():
    inputs = {"a": _randn(2, 3, 5, 7), "w": _randn(1, 3, 4, 7)}
    g, t = _graph(inputs)
    g.relu(g.matmul(t["a"], g.transpose(t["w"], [0, 1, 3, 2]))).set_output(True)
    check_function(g, inputs, tolerance=1e-4)


def test_conv_with_stride_padding_and_groups():
    inputs = {"x": _randn(2, 4, 7, 6), "w": _randn(6, 2, 3, 3)}
    g, t = _graph(inputs)
    g.conv_fprop(t["x"], t["w"], padding=1, stride=2, groups=2).set_output(True)
    check_function(g, inputs, tolerance=1e-4)


@pytest.mark.parametrize("mode", ["max", "avg_include_pad"])
def test_pooling(mode):
    inputs = {"x": _randn(2, 3, 6, 7)}
    g, t = _graph(inputs)
    g.pooling(t["x"], mode, [3, 3], [2, 2], [1, 1]).set_output(True)
    check_function(g, inputs)


def test_dropout_regenerates_its_mask():
    inputs = {"x": _randn(5, 11)}
    g, t = _graph(inputs)
    g.dropout(g.mul(t["x"], 3.0), 0.4, seed=77, offset=5).set_output(True)
    check_function(g, inputs)


def test_sdpa_with_bias_gqa_and_causal_mask():
    inputs = {"q": _randn(2, 4, 9, 8), "k": _randn(2, 2, 11, 8), "v": _randn(2, 2, 11, 8),
              "bias": _randn(1, 4, 9, 11)}
    g, t = _graph(inputs)
    o, _ = g.sdpa(t["q"], t["k"], t["v"], bias=t["bias"], use_causal_mask_bottom_right=True)
    o.set_output(True)
    fn = check_function(g, inputs, tolerance=1e-4)
    derivation = derive(g, fn.inputs, fn.outputs, [True] * 4)
    assert [n.op for n in derivation.backward.nodes if n.op.startswith("sdpa")] == ["sdpa_backward"]


@pytest.mark.parametrize("op", ["transpose", "reshape", "slice", "concatenate"])
def test_layout_ops(op):
    inputs = {"x": _randn(3, 4, 5), "z": _randn(3, 2, 5)}
    g, t = _graph(inputs)
    x = g.mul(t["x"], t["x"])
    y = {"transpose": lambda: g.transpose(x, [2, 0, 1]), "reshape": lambda: g.reshape(x, [12, 5]),
         "slice": lambda: g.slice(x, [slice(1, 3), slice(None), slice(0, 4)]),
         "concatenate": lambda: g.concatenate([x, t["z"], x], axis=1)}[op]()
    g.exp(y).set_output(True)
    if op != "concatenate":
        g.add(t["z"], 1.0).set_output(True)
    check_function(g, inputs)


# --- the function itself --------------------------------------------------------------------------
def test_inputs_that_need_no_gradient_get_none_and_are_not_differentiated():
    inputs = {"x": _randn(4, 3), "w": _randn(3, 2)}
    g, t = _graph(inputs)
    g.matmul(t["x"], t["w"]).set_output(True)
    fn = g.as_function()
    x, w = inputs["x"], inputs["w"].clone().requires_grad_()
    fn(x, w).sum().backward()
    assert w.grad is not None
    (derivation, _), = fn._derivations.values()
    assert derivation.grads[0] is None and [n.op for n in derivation.backward.nodes].count("matmul") == 1


def test_no_grad_call_runs_the_plain_graph_and_returns_a_tuple_for_several_outputs():
    inputs = {"x": _randn(4, 3)}
    g, t = _graph(inputs)
    a, b = g.relu(t["x"]).set_output(True), g.exp(t["x"]).set_output(True)
    fn = g.as_function(inputs=["x"], outputs=[b, a])
    with torch.no_grad():
        first, second = fn(inputs["x"].clone().requires_grad_())
    assert torch.allclose(first, inputs["x"].exp()) and torch.equal(second, inputs["x"].relu())
    assert not fn._derivations


def test_outputs_a_subset_of_the_graph_outputs_or_a_virtual_tensor():
    """as_function(outputs=...) returns those only: the graph's other outputs (and the ops only
    they need) are neither allocated nor bound, with or without autograd."""
    inputs = {"x": _randn(3, 4), "z": _randn(3, 4)}
    g, t = _graph(inputs)
    a = g.exp(t["x"]).set_output(True)
    g.sin(a).set_output(True)
    g.mul(t["z"], 2.0).set_output(True)
    fn = check_function(g, inputs, outputs=[a])
    assert torch.allclose(fn(inputs["x"], inputs["z"]), inputs["x"].exp())
    virtual = g.relu(g.neg(t["x"]))
    g.cos(virtual).set_output(True)
    fn = g.as_function(inputs=["x", "z"], outputs=[virtual])
    x = inputs["x"].clone().requires_grad_()
    fn(x, inputs["z"]).sum().backward()
    assert torch.equal(fn(inputs["x"], inputs["z"]), inputs["x"].neg().relu())
    assert torch.equal(x.grad, -(inputs["x"] < 0).float())


def test_saved_values_keep_their_intermediate_type():
    """A value the backward reads is kept as an output of the forward graph in the type it had
    (float32 between bf16 ops), so the forward's results equal the plain graph's and the backward
    reads the unrounded value."""
    inputs = {"a": _randn(8, 16).bfloat16(), "b": _randn(16, 8).bfloat16()}
    g = dg.Graph(name="fn", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    t = {name: g.tensor_like(value, name) for name, value in inputs.items()}
    scores = g.matmul(t["a"], t["b"])
    g.softmax(scores, 1).set_output(True)
    g.tanh(scores).set_output(True)  # its backward reads tanh's input: the matmul is saved
    fn = g.as_function()
    plain = fn(inputs["a"], inputs["b"])
    recorded = fn(inputs["a"].clone().requires_grad_(), inputs["b"])
    assert all(torch.equal(p, r) for p, r in zip(plain, recorded))
    (derivation, _), = fn._derivations.values()
    assert [t.data_type for t in derivation.saved if t.name == scores.name] == [dg.float32]


def test_an_expanded_input_takes_a_dense_gradient():
    """An input declared with a stride-0 axis (tensor_like of an expanded tensor) gets a gradient
    of its logical dims, densely laid out (torch sums it back through its expand); an argument
    that is not expanded the same way cannot be conformed to it and is refused."""
    bias = _randn(1, 5)
    inputs = {"x": _randn(4, 5), "b": bias.expand(4, 5)}
    g, t = _graph(inputs)
    g.mul(t["x"], t["b"]).set_output(True)
    fn = g.as_function()
    leaf = bias.clone().requires_grad_()
    x = inputs["x"].clone().requires_grad_()
    fn(x, leaf.expand(4, 5)).sum().backward()
    assert torch.allclose(leaf.grad, inputs["x"].sum(0, keepdim=True), atol=1e-5)
    assert torch.allclose(x.grad, bias.expand(4, 5))
    with pytest.raises(dg.ExecutionError, match="expanded"):
        fn(inputs["x"], _randn(4, 5))


def test_double_backward_raises_instead_of_dropping_the_second_order_term():
    """A gradient penalty through as_function needs the backward differentiated, which it is not:
    torch raises rather than treating the first gradient as a constant."""
    inputs = {"x": _randn(3, 4)}
    g, t = _graph(inputs)
    g.exp(t["x"]).set_output(True)
    fn = g.as_function()
    x = inputs["x"].clone().requires_grad_()
    y = fn(x)
    (dx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert torch.allclose(dx, inputs["x"].exp())
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (y.sum() + (dx ** 2).sum()).backward()


def test_an_input_with_other_strides_is_taken_and_the_graph_is_untouched():
    inputs = {"x": _randn(4, 6)}
    g, t = _graph(inputs)
    g.mul(t["x"], 2.0).set_output(True)
    fn = g.as_function()
    odd = torch.randn(6, 4, generator=GEN).t()
    assert torch.equal(fn(odd), odd * 2)
    assert g.plan is None


def test_bad_calls_raise():
    g, t = _graph({"x": _randn(2, 3)})
    g.relu(t["x"]).set_output(True)
    fn = g.as_function()
    with pytest.raises(dg.ExecutionError):
        fn()
    with pytest.raises(dg.ExecutionError):
        fn(torch.randn(3, 2))
    with pytest.raises(dg.ExecutionError):
        fn(torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(dg.ValidationError):
        g.as_function(inputs=["nope"])
    h = dg.Graph()
    with pytest.raises(dg.ValidationError):
        g.as_function(inputs=[h.tensor(name="x", dim=[2, 3])])


# --- training loops -------------------------------------------------------------------------------
def _sgd_steps(step_fn, params, batches, lr=0.05):
    losses = []
    for x, target in batches:
        loss = step_fn(x, target, *params)
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, grad in zip(params, grads):
                p -= lr * grad
    return losses


def test_a_small_mlp_trains_like_torch():
    g = dg.Graph(name="mlp")
    x, w1, b1 = g.tensor(name="x", dim=[16, 10]), g.tensor(name="w1", dim=[10, 32]), g.tensor(name="b1", dim=[1, 32])
    w2, b2 = g.tensor(name="w2", dim=[32, 4]), g.tensor(name="b2", dim=[1, 4])
    g.add(g.matmul(g.silu(g.add(g.matmul(x, w1), b1)), w2), b2).set_output(True)
    fn = g.as_function()

    def ours(x, target, *params):
        return ((fn(x, *params) - target) ** 2).mean()

    def theirs(x, target, w1, b1, w2, b2):
        return ((torch.nn.functional.silu(x @ w1 + b1) @ w2 + b2 - target) ** 2).mean()

    # its own generator and one batch: the loss must fall whatever ran before (on four different
    # batches, last below first depended on the draws other tests left in the shared generator)
    gen = torch.Generator().manual_seed(6)
    init = [torch.randn(10, 32, generator=gen) / 3, torch.zeros(1, 32), torch.randn(32, 4, generator=gen) / 6,
            torch.zeros(1, 4)]
    batches = [(torch.randn(16, 10, generator=gen), torch.randn(16, 4, generator=gen))] * 4
    mine = _sgd_steps(ours, [p.clone().requires_grad_() for p in init], batches)
    ref = _sgd_steps(theirs, [p.clone().requires_grad_() for p in init], batches)
    assert mine[-1] < mine[0]
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(mine, ref)), (mine, ref)


def test_a_small_cnn_trains_like_torch():
    g = dg.Graph(name="cnn")
    x, w, s, b = (g.tensor(name="x", dim=[4, 3, 8, 8]), g.tensor(name="w", dim=[6, 3, 3, 3]),
                  g.tensor(name="s", dim=[1, 6, 1, 1]), g.tensor(name="b", dim=[1, 6, 1, 1]))
    fc = g.tensor(name="fc", dim=[6, 5])
    y = g.relu(g.batchnorm(g.conv_fprop(x, w, padding=1), s, b)[0])
    pooled = g.reshape(g.reduction(y, "mean", [2, 3]), [4, 6])
    g.matmul(pooled, fc).set_output(True)
    fn = g.as_function(inputs=["x", "w", "s", "b", "fc"])

    def ours(x, target, *params):
        return ((fn(x, *params) - target) ** 2).mean()

    def theirs(x, target, w, s, b, fc):
        y = torch.nn.functional.conv2d(x, w, padding=1)
        y = torch.nn.functional.batch_norm(y, None, None, s.view(-1), b.view(-1), training=True, eps=1e-5)
        return ((torch.relu(y).mean((2, 3)) @ fc - target) ** 2).mean()

    init = [torch.randn(6, 3, 3, 3, generator=GEN) / 4, torch.ones(1, 6, 1, 1), torch.zeros(1, 6, 1, 1),
            torch.randn(6, 5, generator=GEN) / 2]
    batches = [(torch.randn(4, 3, 8, 8, generator=GEN), torch.randn(4, 5, generator=GEN)) for _ in range(3)]
    mine = _sgd_steps(ours, [p.clone().requires_grad_() for p in init], batches)
    ref = _sgd_steps(theirs, [p.clone().requires_grad_() for p in init], batches)
    assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(mine, ref)), (mine, ref)


# --- torch.compile and CUDA graphs ----------------------------------------------------------------
def _linear_gelu():
    g = dg.Graph(name="block")
    x, w = g.tensor(name="x", dim=[6, 8]), g.tensor(name="w", dim=[8, 5])
    g.gelu(g.matmul(x, w)).set_output(True)
    return g.as_function()


def test_torch_compile_fullgraph_traces_forward_and_backward():
    """The function is a custom op with a fake implementation: dynamo traces it without a graph
    break (fullgraph=True), forward and backward."""
    fn = _linear_gelu()

    def model(x, w):
        return (fn(torch.tanh(x), w) * 2).sum()

    x, w = _randn(6, 8), _randn(8, 5)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    eager_leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    loss, eager = compiled(*leaves), model(*eager_leaves)
    loss.backward()
    eager.backward()
    assert torch.allclose(loss, eager, rtol=1e-5)
    for mine, theirs in zip(leaves, eager_leaves):
        assert torch.allclose(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(torch.compile(model, fullgraph=True, backend="aot_eager")(x, w), model(x, w), rtol=1e-5)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    fn = _linear_gelu()
    x, w = _randn(6, 8).cuda(), _randn(8, 5).cuda()
    fn(x, w)  # build and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, w)
    x.copy_(_randn(6, 8).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, torch.nn.functional.gelu(x @ w), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_inductor_compiles_a_model_around_the_function():
    fn = _linear_gelu()
    x, w = _randn(6, 8).cuda().requires_grad_(), _randn(8, 5).cuda().requires_grad_()
    compiled = torch.compile(lambda x, w: fn(x * 2, w).square().sum(), fullgraph=True)
    compiled(x, w).backward()
    reference = (torch.nn.functional.gelu((x.detach() * 2).double() @ w.detach().double())).square().sum()
    assert torch.allclose(compiled(x, w).double(), reference, rtol=1e-4)
    assert x.grad is not None and w.grad is not None


@pytest.mark.gpu
def test_bf16_attention_block_gradients_on_the_gpu():
    """q/k/v projections, causal sdpa in BSHD through transposes, an output projection: values
    and gradients in bf16 against torch in float32."""
    b, s, h, d = 2, 200, 4, 64
    g = dg.Graph(name="block", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    x = g.tensor(name="x", dim=[b, s, h * d], data_type=dg.bfloat16)
    ws = [g.tensor(name=n, dim=[h * d, h * d], data_type=dg.bfloat16) for n in ("wq", "wk", "wv", "wo")]
    heads = [g.transpose(g.reshape(g.matmul(x, w), [b, s, h, d]), [0, 2, 1, 3]) for w in ws[:3]]
    o, _ = g.sdpa(*heads, use_causal_mask=True)
    g.matmul(g.reshape(g.transpose(o, [0, 2, 1, 3]), [b, s, h * d]), ws[3]).set_output(True)
    fn = g.as_function()
    gen = torch.Generator(device="cuda").manual_seed(0)
    args = [torch.randn(b, s, h * d, generator=gen, device="cuda").bfloat16()]
    args += [(torch.randn(h * d, h * d, generator=gen, device="cuda") / 16).bfloat16() for _ in range(4)]
    leaves = [a.clone().requires_grad_() for a in args]
    out = fn(*leaves)
    gy = torch.randn(out.shape, generator=gen, device="cuda").bfloat16()
    out.backward(gy)
    ref_leaves = [a.float().requires_grad_() for a in args]
    xr, wq, wk, wv, wo = ref_leaves
    q, k, v = ((xr @ w).view(b, s, h, d).transpose(1, 2) for w in (wq, wk, wv))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h * d) @ wo
    ref.backward(gy.float())
    assert rel_err(out, ref) < 2e-2
    for mine, theirs in zip(leaves, ref_leaves):
        assert rel_err(mine.grad, theirs.grad) < 3e-2


@pytest.mark.parametrize("op", ["layernorm", "rmsnorm", "batchnorm", "instancenorm"])
def test_norm_statistics_as_outputs_take_gradients(op):
    """The mean and inverse variance as outputs too: their gradients reach x (d mean/dx = 1/n,
    d inv/dx = -inv^3 (x - mean)/n)."""
    wide = op in ("batchnorm", "instancenorm")
    inputs = {"x": _randn(3, 4, 5), "scale": _randn(1, 4, 1) if wide else _randn(1, 1, 5),
              "bias": _randn(1, 4, 1) if wide else _randn(1, 1, 5)}
    g, t = _graph(inputs)
    outs = getattr(g, op)(t["x"], t["scale"], t["bias"])
    for out in outs[:3]:
        if out is not None:
            out.set_output(True)
    check_function(g, inputs, tolerance=2e-4)


def test_a_weight_shared_by_the_batch_takes_one_folded_gemm():
    """x [B, M, K] @ w [K, N]: dw is one GEMM over B*M rows, not a batched GEMM and a sum."""
    inputs = {"x": _randn(3, 5, 7), "w": _randn(7, 4)}
    g, t = _graph(inputs)
    g.tanh(g.matmul(t["x"], t["w"])).set_output(True)
    fn = check_function(g, inputs, tolerance=1e-4)
    derivation, _ = fn.derivation((True, True))
    ops = [n.op for n in derivation.backward.nodes]
    assert ops.count("matmul") == 2 and "reduction" not in ops


@pytest.mark.parametrize("window", [(slice(1, 9, 3), slice(None), slice(0, 5, 2)),
                                    (slice(0, 10, 4), slice(2, 3), slice(None)),
                                    (slice(9, 10), slice(0, 4, 5), slice(1, 5, 1)),
                                    (slice(3, 5), slice(1, 4, 2), slice(0, 1))])
def test_strided_slices_put_the_gradient_back_among_zeros(window):
    inputs = {"x": _randn(10, 4, 5)}
    g, t = _graph(inputs)
    g.exp(g.slice(g.mul(t["x"], 0.5), list(window))).set_output(True)
    check_function(g, inputs)
