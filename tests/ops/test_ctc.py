"""CTC loss (ctc_loss) and its gradient (ctc_loss_backward) on CPU through the interpreter: every
reduction with and without zero_infinity against the float64 reference and torch's F.ctc_loss
(float64), poisoned outputs; lengths 0 and 1, repeated labels, impossible alignments, blank not
0, odd T/N/C, padded and concatenated targets, int32 and int64 ids, non-contiguous log_probs and
targets, NaN and -inf in log_probs, half types; autograd through as_function; typed errors for
bad shapes and types and for out-of-range host lengths and labels (nothing written); the kernels
compiled for sm_90; torch.compile of a model using F.ctc_loss; the benchmark shape on the GPU."""
import math

import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg
from helpers import check, compiled_for_sm90, poisoned

TORCH_OF = {dg.float32: torch.float32, dg.float16: torch.float16, dg.bfloat16: torch.bfloat16}
REDUCTIONS = ("none", "sum", "mean")


def _case(steps=8, batch=5, classes=7, width=4, blank=0, index=torch.int64, generator=None):
    """log_probs [T, N, C] and padded targets with, across the batch: a full-length input, a
    repeated label (needs a blank between), an input of length 0 with an empty target, a target
    of length 0, a target of length 1, an input too short for its target (infinite loss)."""
    gen = generator or torch.Generator().manual_seed(0)
    log_probs = torch.randn(steps, batch, classes, generator=gen).log_softmax(-1)
    labels = [c for c in range(classes) if c != blank]
    targets = torch.tensor(labels, dtype=index)[torch.randint(0, len(labels), (batch, width), generator=gen)]
    targets[1, :3] = labels[2]  # three repeats: 5 states at least
    input_lengths = [steps, 5, 0, steps - 2, steps, 2][:batch] + [steps] * max(0, batch - 6)
    target_lengths = [width, 3, 0, 0, 1, 3][:batch] + [width] * max(0, batch - 6)
    return (log_probs, targets, torch.tensor(input_lengths, dtype=index), torch.tensor(target_lengths, dtype=index))


def _loss_graph(values, dtype=dg.float32, **attrs):
    log_probs, targets, input_lengths, target_lengths = values
    g = dg.Graph(name="ctc", io_data_type=dtype, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    x, t = g.tensor_like(log_probs, name="lp"), g.tensor_like(targets, name="targets")
    a, b = g.tensor_like(input_lengths, name="il"), g.tensor_like(target_lengths, name="tl")
    g.ctc_loss(x, t, a, b, **attrs).set_output(True).set_name("loss")
    return g, {"lp": log_probs, "targets": targets, "il": input_lengths, "tl": target_lengths}


def _torch_loss(values, **attrs):
    log_probs, targets, input_lengths, target_lengths = values
    return F.ctc_loss(log_probs.double(), targets, input_lengths, target_lengths, **attrs)


def _same(out: torch.Tensor, expected: torch.Tensor, tolerance: float):
    """Equal NaN and infinity positions, finite values within `tolerance` relative norm."""
    out, expected = out.double().cpu().reshape(expected.shape), expected.double().cpu()
    assert torch.equal(torch.isnan(out), torch.isnan(expected)), (out, expected)
    finite = torch.isfinite(expected)
    assert torch.equal(out[~finite & ~torch.isnan(expected)], expected[~finite & ~torch.isnan(expected)])
    scale = expected[finite].norm().item() or 1.0
    assert (out[finite] - expected[finite]).norm().item() / scale < tolerance


def _checked(g, inputs, expected, tolerance=None):
    """The kernels against the float64 reference (poisoned outputs: helpers.check), and the
    reference of the graph's one output against torch's float64 `expected`."""
    check(g, inputs, tolerance=tolerance)
    _same(g.reference(inputs)[g.outputs()[0].name], expected, 1e-10)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_loss_matches_reference_and_torch(reduction, zero_infinity):
    values = _case()
    g, inputs = _loss_graph(values, reduction=reduction, zero_infinity=zero_infinity)
    _checked(g, inputs, _torch_loss(values, reduction=reduction, zero_infinity=zero_infinity).reshape(-1))


def test_infinite_losses_and_lengths_zero_and_one():
    """Entry 2 (no frame, no label) costs 0, entry 5 (2 frames, 3 labels) is impossible: inf,
    0 with zero_infinity; entry 4 (one label) and 3 (no label) are finite."""
    values = _case(batch=6)
    for zero_infinity in (False, True):
        g, inputs = _loss_graph(values, reduction="none", zero_infinity=zero_infinity)
        g.build()
        out = torch.full([6], math.nan)
        g.execute({**inputs, "loss": out})
        assert out[2].item() == 0.0
        assert out[5].item() == (0.0 if zero_infinity else math.inf)
        assert all(math.isfinite(out[k].item()) and out[k].item() > 0 for k in (0, 1, 3, 4))


def test_input_length_one():
    """One frame: a single label emitted there, or a blank; the loss and its gradient."""
    log_probs = torch.randn(6, 3, 5, generator=torch.Generator().manual_seed(4)).log_softmax(-1)
    values = (log_probs, torch.tensor([[2, 3], [1, 1], [4, 4]]), torch.tensor([1, 1, 6]), torch.tensor([1, 0, 2]))
    g, inputs = _loss_graph(values, reduction="none")
    _checked(g, inputs, _torch_loss(values, reduction="none"))
    grad_loss = torch.randn(3)
    g, inputs = _backward_graph(values, grad_loss, reduction="none")
    _checked(g, inputs, _torch_gradient(values, grad_loss, reduction="none"), 1e-5)


@pytest.mark.parametrize("blank", [0, 3, 6])
@pytest.mark.parametrize("index", [torch.int32, torch.int64])
def test_blank_and_index_types(blank, index):
    values = _case(steps=9, batch=4, classes=7, width=3, blank=blank, index=index)
    g, inputs = _loss_graph(values, reduction="none", blank=blank)
    _checked(g, inputs, _torch_loss(values, reduction="none", blank=blank))


def test_concatenated_targets_and_odd_sizes():
    """1-D targets: each entry's labels after the earlier entries' (T=13, N=3, C=5)."""
    log_probs, padded, input_lengths, target_lengths = _case(steps=13, batch=3, classes=5, width=4)
    target_lengths = torch.tensor([4, 2, 3])
    concatenated = torch.cat([padded[k, :int(n)] for k, n in enumerate(target_lengths)])
    values = (log_probs, concatenated, torch.tensor([13, 6, 9]), target_lengths)
    for reduction in REDUCTIONS:
        g, inputs = _loss_graph(values, reduction=reduction)
        _checked(g, inputs, _torch_loss(values, reduction=reduction).reshape(-1))


def test_strided_log_probs_and_targets():
    """log_probs a transposed view of [N, T, C] storage (and a class stride of 2), targets every
    other column of a wider tensor."""
    log_probs, targets, input_lengths, target_lengths = _case()
    storage = torch.randn(5, 8, 14)
    storage[:, :, ::2] = log_probs.transpose(0, 1)
    strided = storage.transpose(0, 1)[:, :, ::2]
    wide = torch.zeros(5, 9, dtype=targets.dtype)
    wide[:, 1::2] = targets
    values = (strided, wide[:, 1::2], input_lengths, target_lengths)
    assert not values[0].is_contiguous() and not values[1].is_contiguous()
    g, inputs = _loss_graph(values, reduction="none")
    _checked(g, inputs, _torch_loss((log_probs, targets, input_lengths, target_lengths), reduction="none"))


def test_nan_and_minus_inf_in_log_probs():
    """A NaN on a used frame makes that entry's loss NaN; a -inf class gives probability 0."""
    log_probs, targets, input_lengths, target_lengths = _case()
    log_probs[3, 0, :] = math.nan
    log_probs[:, 4, int(targets[4, 0])] = -math.inf  # entry 4's only label never emitted: inf
    values = (log_probs, targets, input_lengths, target_lengths)
    g, inputs = _loss_graph(values, reduction="none")
    _checked(g, inputs, _torch_loss(values, reduction="none"))
    out = g.reference(inputs)["loss"]  # what the kernel gave (checked above)
    assert math.isnan(out[0].item()) and out[4].item() == math.inf and math.isfinite(out[1].item())
    grad_loss = torch.randn(5)
    g, inputs = _backward_graph(values, grad_loss, reduction="none", zero_infinity=True)
    _checked(g, inputs, _torch_gradient(values, grad_loss, reduction="none", zero_infinity=True), 1e-5)


@pytest.mark.parametrize("dtype", [dg.float16, dg.bfloat16])
def test_half_types(dtype):
    log_probs, *rest = _case()
    values = (log_probs.to(TORCH_OF[dtype]), *rest)
    g, inputs = _loss_graph(values, dtype=dtype, reduction="sum", zero_infinity=True)
    check(g, inputs)
    g, inputs = _backward_graph(values, torch.randn(1).to(TORCH_OF[dtype]), dtype=dtype, reduction="sum",
                                zero_infinity=True)
    check(g, inputs)


# --- the gradient ---------------------------------------------------------------------------------
def _backward_graph(values, grad_loss, dtype=dg.float32, **attrs):
    log_probs, targets, input_lengths, target_lengths = values
    g = dg.Graph(name="ctc_bwd", io_data_type=dtype, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    x, t = g.tensor_like(log_probs, name="lp"), g.tensor_like(targets, name="targets")
    a, b = g.tensor_like(input_lengths, name="il"), g.tensor_like(target_lengths, name="tl")
    dl = g.tensor_like(grad_loss, name="dloss")
    g.ctc_loss_backward(x, t, a, b, dl, **attrs).set_output(True).set_name("dlp")
    return g, {"lp": log_probs, "targets": targets, "il": input_lengths, "tl": target_lengths, "dloss": grad_loss}


def _torch_gradient(values, grad_loss, **attrs):
    log_probs = values[0].double().requires_grad_()
    loss = F.ctc_loss(log_probs, *values[1:], **attrs)
    loss.backward(grad_loss.double().reshape(loss.shape))
    return log_probs.grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_gradient_matches_reference_and_torch(reduction, zero_infinity):
    values = _case(batch=6)
    grad_loss = torch.randn(6 if reduction == "none" else 1)
    g, inputs = _backward_graph(values, grad_loss, reduction=reduction, zero_infinity=zero_infinity)
    _checked(g, inputs, _torch_gradient(values, grad_loss, reduction=reduction, zero_infinity=zero_infinity), 1e-5)
    # an impossible alignment's frames are NaN in torch, 0 with zero_infinity; frames past the
    # input are 0
    out = g.reference(inputs)["dlp"]
    assert torch.isnan(out[:2, 5]).all() != zero_infinity and (out[2:, 5] == 0).all() and (out[:, 2] == 0).all()


@pytest.mark.parametrize("blank", [0, 4])
def test_gradient_blank_concatenated_strided(blank):
    """Blank not 0, concatenated int32 targets, log_probs and the gradient transposed."""
    log_probs, padded, _, _ = _case(steps=10, batch=3, classes=6, width=3, blank=blank, index=torch.int32)
    target_lengths = torch.tensor([3, 1, 2], dtype=torch.int32)
    concatenated = torch.cat([padded[k, :int(n)] for k, n in enumerate(target_lengths)])
    strided = log_probs.transpose(0, 1).contiguous().transpose(0, 1)
    values = (strided, concatenated, torch.tensor([10, 7, 4], dtype=torch.int32), target_lengths)
    grad_loss = torch.randn(1)
    g, inputs = _backward_graph(values, grad_loss, reduction="mean", blank=blank)
    assert tuple(g.outputs()[0].stride) == strided.stride()  # the gradient takes log_probs' layout
    _checked(g, inputs, _torch_gradient(values, grad_loss, reduction="mean", blank=blank), 1e-5)


def _training_graph(values, grad_loss, **attrs):
    """The loss with its log_alpha marked as an output, and the gradient taking that log_alpha
    (the backward rule's form)."""
    g, inputs = _loss_graph(values, **attrs)
    log_alpha = g.outputs()[0].producer.outputs[1].set_output(True).set_name("log_alpha")
    dloss = g.tensor_like(grad_loss, name="dloss")
    operands = [g.tensor_by_name(name) for name in ("lp", "targets", "il", "tl")]
    g.ctc_loss_backward(*operands, dloss, log_alpha=log_alpha, **attrs).set_output(True).set_name("dlp")
    return g, {**inputs, "dloss": grad_loss}


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_log_alpha_output_and_the_gradient_from_it(zero_infinity):
    """log_alpha (-inf past each entry's frames and states) against the reference, and the
    gradient that reads it instead of running its own alpha pass against torch's."""
    values = _case(batch=6)
    grad_loss = torch.randn(1)
    g, inputs = _training_graph(values, grad_loss, reduction="mean", zero_infinity=zero_infinity)
    check(g, inputs, tolerance=1e-5)
    expected = _torch_gradient(values, grad_loss, reduction="mean", zero_infinity=zero_infinity)
    _same(g.reference(inputs)["dlp"], expected, 1e-10)


def test_bad_log_alpha_raises():
    g, inputs = _declared()
    grad = g.tensor(name="dl", dim=[1], data_type=dg.float32)
    wrong = g.tensor(name="la", dim=[3, 7, 8], data_type=dg.float32)  # 2 * S + 1 = 9
    with pytest.raises(dg.ValidationError, match="log_alpha"):
        g.ctc_loss_backward(*inputs, grad, log_alpha=wrong)


def test_autograd_through_as_function():
    """as_function's backward (the backward rule's ctc_loss_backward) against torch's gradient."""
    values = _case()
    g, _ = _loss_graph(values, reduction="mean", zero_infinity=True)
    fn = g.as_function()
    log_probs = values[0].clone().requires_grad_()
    loss = fn(log_probs, *values[1:])
    loss.backward(torch.tensor([0.7]))
    expected = _torch_gradient(values, torch.tensor([0.7]), reduction="mean", zero_infinity=True)
    _same(log_probs.grad, expected, 1e-5)
    _same(loss.detach(), _torch_loss(values, reduction="mean", zero_infinity=True).reshape(1), 2e-5)


def test_autograd_through_log_softmax():
    """A head's log_softmax in the same graph: the loss and d logits (through softmax_backward)
    against torch's."""
    values = _case()
    logits = torch.randn(values[0].shape, generator=torch.Generator().manual_seed(3))
    g = dg.Graph(name="head", io_data_type=dg.float32)
    x = g.tensor_like(logits, name="logits")
    rest = [g.tensor_like(v, name=n) for v, n in zip(values[1:], ("targets", "il", "tl"))]
    g.ctc_loss(g.softmax(x, axis=-1, log=True), *rest, reduction="sum", zero_infinity=True).set_output(True)
    leaf = logits.clone().requires_grad_()
    loss = g.as_function()(leaf, *values[1:])
    loss.backward()
    leaf64 = logits.double().requires_grad_()
    expected = F.ctc_loss(leaf64.log_softmax(-1), *values[1:], reduction="sum", zero_infinity=True)
    expected.backward()
    _same(loss.detach(), expected.detach().reshape(1), 2e-5)
    _same(leaf.grad, leaf64.grad, 1e-5)


def test_json_round_trip():
    values = _case()
    g, inputs = _loss_graph(values, reduction="sum", blank=0, zero_infinity=True)
    g2 = dg.Graph.from_json(g.to_json())
    check(g2, inputs)


# --- errors ----------------------------------------------------------------------------------------
def _declared(**dims):
    """Declared inputs of ctc_loss (T=7, N=3, C=5, S=4) with `dims` changing some."""
    g = dg.Graph(name="bad", io_data_type=dg.float32)
    spec = {"lp": ([7, 3, 5], dg.float32), "targets": ([3, 4], dg.int64), "il": ([3], dg.int64),
            "tl": ([3], dg.int64)}
    spec.update(dims)
    return g, [g.tensor(name=name, dim=dim, data_type=dtype) for name, (dim, dtype) in spec.items()]


@pytest.mark.parametrize("change", [
    {"lp": ([7, 15], dg.float32)}, {"lp": ([7, 3, 5], dg.int32)}, {"targets": ([3, 4], dg.float32)},
    {"targets": ([2, 4], dg.int64)}, {"targets": ([3, 4, 1], dg.int64)}, {"il": ([3], dg.float32)},
    {"il": ([4], dg.int64)}, {"tl": ([3, 1], dg.int32)}])
def test_bad_shapes_and_types_raise(change):
    g, inputs = _declared(**change)
    with pytest.raises(dg.ValidationError):
        g.ctc_loss(*inputs)
    assert not g.outputs() and not g._nodes


@pytest.mark.parametrize("attrs", [{"blank": 5}, {"blank": -1}, {"reduction": "max"}, {"zero_infinity": 1},
                                   {"blank": 1.0}])
def test_bad_attributes_raise(attrs):
    g, inputs = _declared()
    with pytest.raises(dg.ValidationError):
        g.ctc_loss(*inputs, **attrs)


def test_bad_grad_loss_raises():
    g, inputs = _declared()
    grad = g.tensor(name="dl", dim=[3], data_type=dg.float32)
    with pytest.raises(dg.ValidationError):
        g.ctc_loss_backward(*inputs, grad, reduction="mean")  # a mean's gradient is [1]


@pytest.mark.parametrize("which, value", [("il", 12), ("il", -1), ("tl", 5), ("tl", -2), ("label", 7),
                                          ("label", -1)])
def test_out_of_range_host_values_raise_and_write_nothing(which, value):
    """Lengths past T or S (or negative) and labels outside [0, C): ExecutionError before any
    kernel runs (loss and gradient graphs), the outputs left as they were; the reference raises
    ValidationError."""
    values = list(_case(steps=11, batch=5, classes=7, width=4))
    if which == "label":
        values[1] = values[1].clone()
        values[1][0, 1] = value
    else:
        position = 2 if which == "il" else 3
        values[position] = values[position].clone()
        values[position][0] = value
    g, inputs = _loss_graph(values, reduction="none")
    g.build()
    out = torch.full([5], 123.0)
    with pytest.raises(dg.ExecutionError, match="ctc_loss"):
        g.execute({**inputs, "loss": out})
    assert (out == 123.0).all()
    with pytest.raises(dg.ValidationError):
        g.reference(inputs)
    g, inputs = _backward_graph(values, torch.randn(5), reduction="none")
    g.build()
    out = torch.full([11, 5, 7], 123.0)
    with pytest.raises(dg.ExecutionError, match="ctc_loss_backward"):
        g.execute({**inputs, "dlp": out})
    assert (out == 123.0).all()


def test_concatenated_total_past_targets_raises():
    log_probs, padded, input_lengths, _ = _case(batch=3)
    values = (log_probs, padded[0, :4].clone(), input_lengths[:3], torch.tensor([2, 2, 1]))
    g, inputs = _loss_graph(values, reduction="none")
    g.build()
    with pytest.raises(dg.ExecutionError, match="concatenated"):
        g.execute({**inputs, "loss": torch.zeros(3)})


def test_too_many_states_is_unsupported():
    g, inputs = _declared(targets=([3, 5000], dg.int64))
    g.ctc_loss(*inputs).set_output(True)
    with pytest.raises(dg.UnsupportedError, match="extended states"):
        g.build()


# --- the GPU compiler, torch.compile ----------------------------------------------------------------
def sm90_graphs():
    """The loss of each reduction, padded and concatenated, and the gradient, for the sm_90
    compile check."""
    values = _case()
    for reduction in ("none", "mean"):
        g, _ = _loss_graph(values, reduction=reduction, zero_infinity=True)
        g.build()
        yield f"loss {reduction}", g
    log_probs, padded, input_lengths, target_lengths = values
    concatenated = torch.cat([padded[k, :int(n)] for k, n in enumerate(target_lengths)])
    g, _ = _loss_graph((log_probs.bfloat16(), concatenated, input_lengths, target_lengths), dtype=dg.bfloat16,
                       reduction="sum")
    g.build()
    yield "loss concatenated bf16", g
    g, _ = _backward_graph(values, torch.randn(1), reduction="mean", zero_infinity=True)
    g.build()
    yield "gradient", g
    g, _ = _training_graph(values, torch.randn(1), reduction="mean")
    g.build()
    yield "loss storing log_alpha, gradient reading it", g


def test_kernels_compile_for_sm90():
    assert "compiled 11 kernels for sm_90" in compiled_for_sm90("test_ctc:sm90_graphs", timeout=400)


class _SpeechHead(torch.nn.Module):
    """A linear layer, log_softmax and F.ctc_loss: the loss (a graph break in torch.compile: its
    log_alpha's dims depend on the lengths' values) runs where dynamo puts it."""

    def __init__(self, features, classes):
        super().__init__()
        self.proj = torch.nn.Linear(features, classes)

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = self.proj(x).log_softmax(-1)
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, zero_infinity=True)


def test_torch_compile_model_with_ctc_loss():
    torch.manual_seed(0)
    model = _SpeechHead(6, 5)
    x = torch.randn(9, 3, 6)
    targets = torch.randint(1, 5, (3, 3))
    input_lengths, target_lengths = torch.tensor([9, 7, 2]), torch.tensor([3, 2, 3])
    eager = model(x, targets, input_lengths, target_lengths)
    eager.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="dnngraph")
    loss = compiled(x, targets, input_lengths, target_lengths)
    loss.backward()
    assert torch.allclose(loss, eager, rtol=1e-5, atol=1e-6)
    for got, want in zip((p.grad for p in model.parameters()), expected):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_out_of_range_lengths_are_clamped_on_gpu():
    """On the GPU lengths are never read back: an input length past T counts as T, a target
    length past S as S, and a label outside the classes gives an infinite loss; nothing outside
    the tensors is read (compute-sanitizer would say) and every output element is written."""
    log_probs, targets, input_lengths, target_lengths = (v.cuda() for v in _case())
    clamped = (log_probs, targets, input_lengths.clone(), target_lengths.clone())
    bad_targets = targets.clone()
    bad_targets[4, 0] = 99
    over = (log_probs, bad_targets, input_lengths + 50, target_lengths.clone())
    over[3][0] = 40  # past S = 4
    clamped[3][0] = 4
    clamped[2][:] = torch.minimum(input_lengths + 50, torch.tensor(8, device="cuda"))
    results = []
    for values in (clamped, over):
        g, inputs = _loss_graph(values, reduction="none")
        g.build()
        out = torch.full([5], math.nan, device="cuda")
        g.execute({**inputs, "loss": out})
        results.append(out.cpu())
    assert torch.equal(results[0][:4], results[1][:4]) and results[1][4].item() == math.inf


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [dg.float32, dg.bfloat16])
def test_benchmark_shape_on_gpu(dtype):
    """T=500, N=32, C=29, targets of up to 100: loss and gradient against torch's on the GPU."""
    gen = torch.Generator().manual_seed(1)
    steps, batch, classes, width = 500, 32, 29, 100
    log_probs = torch.randn(steps, batch, classes, generator=gen).log_softmax(-1)
    targets = torch.randint(1, classes, (batch, width), generator=gen)
    input_lengths = torch.randint(400, steps + 1, (batch,), generator=gen)
    target_lengths = torch.randint(60, width + 1, (batch,), generator=gen)
    values = (log_probs.to(TORCH_OF[dtype]).cuda(), targets.cuda(), input_lengths.cuda(), target_lengths.cuda())
    g, inputs = _loss_graph(values, dtype=dtype, reduction="mean")
    fn = g.as_function()
    lp = values[0].clone().requires_grad_()
    loss = fn(lp, *values[1:])
    loss.backward()
    cpu_values = tuple(v.cpu() for v in values)
    # fp32 math over 500 frames; a bf16 loss and gradient are rounded once when stored (2^-9).
    # The fp32 gradient's error is that of log-space alpha and beta near -2000 (an ulp 1.2e-4 a
    # step, over hundreds of steps): torch's own fp32 ctc_loss is 4.2e-4 off the float64 one here
    # (the interpreter runs this kernel's fp32 math 4.1e-4 off), so the yardstick is torch's fp32.
    want_grad = _torch_gradient(cpu_values, torch.ones(1), reduction="mean")
    if dtype == dg.float32:
        fp32 = cpu_values[0].clone().requires_grad_()
        F.ctc_loss(fp32, *cpu_values[1:], reduction="mean").backward()
        yardstick = (fp32.grad.double() - want_grad).norm().item() / want_grad.norm().item()
        loss_tolerance, grad_tolerance = 2e-5, 2e-4 + 2 * yardstick
    else:
        loss_tolerance, grad_tolerance = 8e-3, 8e-3
    _same(loss.detach(), _torch_loss(cpu_values, reduction="mean").reshape(1), loss_tolerance)
    _same(lp.grad, want_grad, grad_tolerance)
