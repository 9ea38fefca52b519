"""Attention written as ops, differentiated: the forward stays one flash kernel, the backward
becomes the flash backward (a log-sum-exp pass, dK/dV and dQ kernels with the score ops and
their gradients inside), and every gradient matches torch autograd on the float64 reference."""
import pytest
import torch

import dnngraph as dg
from dnngraph.fusion import partition
from helpers import rel_err

GEN = torch.Generator().manual_seed(31)


def _chain(rank=4, b=2, h=3, s_q=21, s_kv=37, d=16, dv=24, softcap=None, mask=True, dropout=None,
           dtype=torch.float32, kt_contiguous=False, key_bias=False):
    """matmul(q, kt) * scale + bias (-> softcap) -> causal where -> softmax (-> dropout) -> @ v,
    with names that look like kernel variables."""
    lead = [b, h] if rank == 4 else [b * h]
    q_t = torch.randn(lead + [s_q, d], generator=GEN).to(dtype)
    k_t = torch.randn(lead + [s_kv, d], generator=GEN).to(dtype)
    kt_t = k_t.transpose(-1, -2).contiguous() if kt_contiguous else k_t.transpose(-1, -2)
    v_t = torch.randn(lead + [s_kv, dv], generator=GEN).to(dtype)
    bias_shape = [1] * (rank - 2) + ([1, s_kv] if key_bias else [s_q, s_kv])
    bias_t = torch.randn(bias_shape, generator=GEN).to(dtype)
    mask_t = (torch.arange(s_kv).view(1, -1) <= torch.arange(s_q).view(-1, 1) + (s_kv - s_q))
    mask_t = mask_t.view([1] * (rank - 2) + [s_q, s_kv])
    g = dg.Graph(name="ops", io_data_type=dg.float32 if dtype == torch.float32 else dg.float16,
                 intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    inputs = {"q_tile": q_t, "k_ptr": kt_t, "p_tile": v_t, "scores": bias_t}
    t = {name: g.tensor_like(value, name) for name, value in inputs.items()}
    s = g.add(g.mul(g.matmul(t["q_tile"], t["k_ptr"]), 1.0 / d ** 0.5), t["scores"])
    if softcap is not None:
        s = g.mul(g.tanh(g.div(s, softcap)), softcap)
    if mask:
        inputs["visible"] = mask_t
        t["visible"] = g.tensor_like(mask_t, "visible")
        s = g.where(t["visible"], s, float("-inf"))
    probs = g.softmax(s, axis=-1)
    if dropout is not None:
        probs = g.dropout(probs, dropout, 1234, 5)
    g.matmul(probs, t["p_tile"]).set_output(True).set_name("out")
    return g, inputs


def _close(value, expected, tolerance, name):
    """NaN exactly where the reference has NaN, close elsewhere."""
    assert torch.equal(value.isnan(), expected.isnan()), name
    keep = ~expected.isnan()
    assert rel_err(value[keep], expected[keep]) < tolerance, f"{name}: {rel_err(value[keep], expected[keep])}"


def _check(g, inputs, wanted, tolerance=2e-5, kinds=None, options=None):
    """as_function (building with `options`) forward and backward against torch autograd on the
    float64 reference; returns the derivation."""
    fn = g.as_function(options=options)
    args = [inputs[t.name].clone().requires_grad_(t.name in wanted) for t in fn.inputs]
    out = fn(*args)
    grad_out = torch.randn(out.shape, generator=GEN).to(device=out.device, dtype=out.dtype)
    out.backward(grad_out)
    leaves = {n: v.double().requires_grad_(n in wanted) if v.is_floating_point() else v for n, v in inputs.items()}
    ref = g.reference(leaves)["out"]
    _close(out, ref, tolerance, "out")
    grads = torch.autograd.grad(ref, [leaves[n] for n in wanted], grad_out.double())
    for name, expected in zip(wanted, grads):
        arg = args[[t.name for t in fn.inputs].index(name)]
        assert arg.grad is not None and arg.grad.shape == arg.shape
        _close(arg.grad, expected, tolerance, "d" + name)
    mask = tuple(t.name in wanted for t in fn.inputs)
    derivation, _ = fn.derivation(mask)
    if kinds is not None:
        assert [l.group.kind for l in derivation.backward.plan.launches] == kinds
    return derivation


ALL = ("q_tile", "k_ptr", "p_tile")
FUSED = ["reduction", "attention_backward", "attention_backward", "attention_backward"]  # casts stored by it


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_forward_one_kernel_backward_flash(rank, softcap):
    """scale + bias + softcap + causal where: the forward is one attention kernel, the backward
    the delta row sum, the three flash kernels and the casts of dq, dk, dv."""
    g, inputs = _chain(rank=rank, softcap=softcap)
    derivation = _check(g, inputs, ALL, kinds=FUSED)
    assert [l.group.kind for l in derivation.forward.plan.launches] == ["attention"]
    assert not derivation.saved or all(t.dim[-1] != 37 for t in derivation.saved)  # no P saved


@pytest.mark.parametrize("wanted, kernels", [(("p_tile",), 2), (("q_tile",), 2), (("k_ptr",), 2),
                                             (("q_tile", "p_tile"), 3)])
def test_some_gradients(wanted, kernels):
    """Only the wanted products run: dV alone needs no dP, no delta and no dQ kernel."""
    g, inputs = _chain(softcap=3.0)
    derivation = _check(g, inputs, wanted)
    fused = [l for l in derivation.backward.plan.launches if l.group.kind == "attention_backward"]
    assert len(fused) == kernels
    assert len({id(l.group) for l in fused}) == 1


def test_dropout_draws_the_forward_mask():
    g, inputs = _chain(s_q=19, s_kv=27, dv=8, dropout=0.3, softcap=4.0)
    _check(g, inputs, ALL, kinds=FUSED)


def test_fully_masked_rows_are_nan_as_in_torch():
    """Sq > Skv with a bottom-right mask: the first rows see no key; torch's softmax of such a
    row is NaN, and so are the gradients it reaches."""
    g, inputs = _chain(b=1, h=2, s_q=40, s_kv=23, kt_contiguous=True)
    _check(g, inputs, ALL)


def test_unmasked_plain_chain_and_one_key_bias():
    """No mask, a bias constant along the queries; odd sizes past one block."""
    g, inputs = _chain(b=1, h=1, s_q=70, s_kv=45, d=24, dv=40, mask=False, key_bias=True)
    _check(g, inputs, ALL, kinds=FUSED)


def test_fp16():
    g, inputs = _chain(dtype=torch.float16, softcap=5.0, s_q=17, s_kv=33)
    _check(g, inputs, ALL, tolerance=3e-3)


def test_a_side_that_wants_a_gradient_runs_unfused():
    """A bias whose gradient is wanted reads dS' outside the pattern: the backward stays op by
    op (and is still right)."""
    g, inputs = _chain(softcap=4.0)
    derivation = _check(g, inputs, ALL + ("scores",))
    assert "attention_backward" not in [l.group.kind for l in derivation.backward.plan.launches]


@pytest.mark.parametrize("dk_form", ["dkt", "dk"])
def test_hand_written_backward_fuses_and_is_right(dk_form):
    """The pattern is matched on what the nodes compute: a backward written by hand in that form
    is one group, checked against torch; dK as matmul(q^T, dS) (transposed) or matmul(dS^T, q)."""
    q_t, kt_t, v_t = (torch.randn(2, 13, 8, generator=GEN), torch.randn(2, 8, 19, generator=GEN),
                      torch.randn(2, 19, 8, generator=GEN))
    o_t, do_t = torch.randn(2, 13, 8, generator=GEN), torch.randn(2, 13, 8, generator=GEN)
    g = dg.Graph(name="hand", intermediate_data_type=dg.float32)
    q, kt, v, o, d_o = (g.tensor_like(x, n) for x, n in ((q_t, "q"), (kt_t, "kt"), (v_t, "v"), (o_t, "o"),
                                                         (do_t, "do")))
    p = g.softmax(g.mul(g.matmul(q, kt), 0.5))
    delta = g.reduction(g.mul(o, d_o), "sum", [2])
    ds = g.mul(g.mul(p, g.sub(g.matmul(d_o, g.transpose(v, [0, 2, 1])), delta)), 0.5)
    g.matmul(ds, g.transpose(kt, [0, 2, 1])).set_output(True).set_name("dq")
    if dk_form == "dkt":
        g.matmul(g.transpose(q, [0, 2, 1]), ds).set_output(True).set_name("dkt")
    else:
        g.matmul(g.transpose(ds, [0, 2, 1]), q).set_output(True).set_name("dkt")
    g.matmul(g.transpose(p, [0, 2, 1]), d_o).set_output(True).set_name("dv")
    kinds = [grp.kind for grp in partition(g)]
    g._restore_strides()
    assert kinds == ["reduction", "attention_backward"]
    g.build()
    dk_shape = (2, 8, 19) if dk_form == "dkt" else (2, 19, 8)
    results = {n: torch.full(s, float("nan")) for n, s in (("dq", (2, 13, 8)), ("dkt", dk_shape), ("dv", (2, 19, 8)))}
    g.execute({"q": q_t, "kt": kt_t, "v": v_t, "o": o_t, "do": do_t, **results})
    s = torch.softmax((q_t.double() @ kt_t.double()) * 0.5, -1)
    dp = do_t.double() @ v_t.double().transpose(1, 2)
    d = (s * (dp - (o_t.double() * do_t.double()).sum(-1, keepdim=True))) * 0.5
    assert rel_err(results["dq"], d @ kt_t.double().transpose(1, 2)) < 1e-5
    dkt = q_t.double().transpose(1, 2) @ d
    assert rel_err(results["dkt"], dkt if dk_form == "dkt" else dkt.transpose(1, 2)) < 1e-5
    assert rel_err(results["dv"], s.transpose(1, 2) @ do_t.double()) < 1e-5


def test_mismatched_dropout_masks_are_not_fused():
    """dV through one mask and dP through another: not the flash backward's single mask."""
    q_t, kt_t, v_t = (torch.randn(1, 9, 8, generator=GEN), torch.randn(1, 8, 11, generator=GEN),
                      torch.randn(1, 11, 8, generator=GEN))
    g = dg.Graph(name="masks", intermediate_data_type=dg.float32)
    q, kt, v, o, d_o = (g.tensor_like(x, n) for x, n in ((q_t, "q"), (kt_t, "kt"), (v_t, "v"), (q_t, "o"),
                                                         (q_t, "do")))
    p = g.softmax(g.matmul(q, kt))
    delta = g.reduction(g.mul(o, d_o), "sum", [2])
    dp = g.dropout(g.matmul(d_o, g.transpose(v, [0, 2, 1])), 0.2, 1, 0)
    ds = g.mul(p, g.sub(dp, delta))
    g.matmul(ds, g.transpose(kt, [0, 2, 1])).set_output(True)
    g.matmul(g.transpose(g.dropout(p, 0.2, 2, 0), [0, 2, 1]), d_o).set_output(True)
    kinds = [grp.kind for grp in partition(g)]
    g._restore_strides()
    assert "attention_backward" not in kinds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d, dropout", [(64, None), (128, 0.1)])
def test_bf16_bshd_chain_on_the_gpu(d, dropout):
    """bf16 q, k, v in BSHD through transposes (views), scale + softcap + causal where (+ dropout):
    one forward kernel, the flash backward, gradients within bf16 tolerance of float64."""
    b, s_q, s_kv, h = 2, 300, 333, 4
    gen = torch.Generator(device="cuda").manual_seed(3)
    q_t, k_t, v_t = (torch.randn(b, s, h, d, generator=gen, device="cuda").bfloat16() for s in (s_q, s_kv, s_kv))
    mask_t = (torch.arange(s_kv, device="cuda").view(1, -1) <= torch.arange(s_q, device="cuda").view(-1, 1) + 33)
    g = dg.Graph(name="bshd", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32)
    q, k, v, mask = (g.tensor_like(x, n) for x, n in ((q_t, "q"), (k_t, "k"), (v_t, "v"), (mask_t, "mask")))
    heads = [g.transpose(x, [0, 2, 1, 3]) for x in (q, k, v)]
    s = g.mul(g.matmul(heads[0], g.transpose(heads[1], [0, 1, 3, 2])), d ** -0.5)
    s = g.where(mask, g.mul(g.tanh(g.div(s, 20.0)), 20.0), float("-inf"))
    probs = g.softmax(s)
    if dropout:
        probs = g.dropout(probs, dropout, 99, 7)
    g.matmul(probs, heads[2]).set_output(True).set_name("out")
    inputs = {"q": q_t, "k": k_t, "v": v_t, "mask": mask_t}
    derivation = _check(g, inputs, ("q", "k", "v"), tolerance=2e-2)
    assert [l.group.kind for l in derivation.forward.plan.launches] == ["attention"]
    assert [l.group.kind for l in derivation.backward.plan.launches].count("attention_backward") == 3
