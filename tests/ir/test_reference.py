"""g.reference for every family, checked against independent torch computations."""
import pytest
import torch
import torch.nn.functional as F

import dnngraph as dg


def ref_of(g, out, bindings):
    out.set_output(True)
    return g.reference(bindings)[out.name]


def close(a, b, tol=1e-9):
    assert (a.double() - b.double()).norm() <= tol * (b.double().norm() + 1e-30)


@pytest.mark.parametrize("mode", ["cross_correlation", "convolution"])
@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_conv_fprop_dgrad_wgrad(mode, spatial):
    torch.manual_seed(0)
    x_t = torch.randn([2, 4] + [7] * spatial, dtype=torch.float64)
    w_t = torch.randn([6, 2] + [3] * spatial, dtype=torch.float64)
    kw = dict(padding=[1] * spatial, stride=[2] * spatial, dilation=[1] * spatial, groups=2, mode=mode)
    g = dg.Graph()
    x, w = g.tensor_like(x_t.float(), "x"), g.tensor_like(w_t.float(), "w")
    y = g.conv_fprop(x, w, **kw)
    w_eff = w_t.flip(list(range(2, 2 + spatial))) if mode == "convolution" else w_t
    conv = (F.conv1d, F.conv2d, F.conv3d)[spatial - 1]
    expected = conv(x_t, w_eff, stride=2, padding=1, groups=2)
    close(ref_of(g, y, {"x": x_t, "w": w_t}), expected)
    dy_t = torch.randn(expected.shape, dtype=torch.float64)
    leaf_x, leaf_w = x_t.clone().requires_grad_(), w_t.clone().requires_grad_()
    out = conv(leaf_x, leaf_w.flip(list(range(2, 2 + spatial))) if mode == "convolution" else leaf_w,
               stride=2, padding=1, groups=2)
    gx, gw = torch.autograd.grad(out, (leaf_x, leaf_w), dy_t)
    g2 = dg.Graph()
    dy, w2, x2 = g2.tensor_like(dy_t.float(), "dy"), g2.tensor_like(w_t.float(), "w"), g2.tensor_like(x_t.float(), "x")
    dx = g2.conv_dgrad(dy, w2, x_dim=list(x_t.shape), **kw).set_output(True)
    dw = g2.conv_wgrad(dy, x2, w_dim=list(w_t.shape), **kw).set_output(True)
    refs = g2.reference({"dy": dy_t, "w": w_t, "x": x_t})
    close(refs[dx.name], gx)
    close(refs[dw.name], gw)


def test_norms_forward_match_torch():
    torch.manual_seed(1)
    x_t = torch.randn(3, 6, 5, 4, dtype=torch.float64) * 3 + 2
    s_t, b_t = torch.randn(1, 6, 1, 1, dtype=torch.float64), torch.randn(1, 6, 1, 1, dtype=torch.float64)
    g = dg.Graph()
    x, s, b = g.tensor_like(x_t.float(), "x"), g.tensor_like(s_t.float(), "s"), g.tensor_like(b_t.float(), "b")
    rm, rv = g.tensor(name="rm", dim=[1, 6, 1, 1]), g.tensor(name="rv", dim=[1, 6, 1, 1])
    bn = g.batchnorm(x, s, b, rm, rv, epsilon=1e-5, momentum=0.1)
    gn = g.groupnorm(x, s, b, groups=3)
    inn = g.instancenorm(x, s, b)
    for t in list(bn) + list(gn) + list(inn):
        t.set_output(True)
    rm_t, rv_t = torch.randn(1, 6, 1, 1, dtype=torch.float64), torch.rand(1, 6, 1, 1, dtype=torch.float64) + 0.5
    refs = g.reference({"x": x_t, "s": s_t, "b": b_t, "rm": rm_t, "rv": rv_t})
    run_mean, run_var = rm_t.flatten().clone(), rv_t.flatten().clone()
    expected = F.batch_norm(x_t, run_mean, run_var, s_t.flatten(), b_t.flatten(), training=True, momentum=0.1)
    close(refs[bn[0].name], expected)
    close(refs[bn[3].name].flatten(), run_mean)
    close(refs[bn[4].name].flatten(), run_var)
    close(refs[gn[0].name], F.group_norm(x_t, 3, s_t.flatten(), b_t.flatten()))
    close(refs[inn[0].name], F.instance_norm(x_t, weight=s_t.flatten(), bias=b_t.flatten()))
    assert refs[gn[1].name].shape == (3, 3, 1, 1)


def test_layernorm_rmsnorm_forward_and_backward_against_autograd():
    torch.manual_seed(2)
    x_t = torch.randn(4, 7, 10, dtype=torch.float64) * 2 + 1
    s_t, b_t = torch.randn(1, 1, 10, dtype=torch.float64), torch.randn(1, 1, 10, dtype=torch.float64)
    dy_t = torch.randn(4, 7, 10, dtype=torch.float64)
    g = dg.Graph()
    x, s, b, dy = (g.tensor_like(t.float(), n) for t, n in ((x_t, "x"), (s_t, "s"), (b_t, "b"), (dy_t, "dy")))
    y, mean, inv = g.layernorm(x, s, b)
    dx, ds, db = g.layernorm_backward(dy, x, s, mean, inv)
    ry, rinv = g.rmsnorm(x, s, b)
    rdx, rds, rdb = g.rmsnorm_backward(dy, x, s, rinv, has_dbias=True)
    for t in (y, dx, ds, db, ry, rdx, rds, rdb):
        t.set_output(True)
    refs = g.reference({"x": x_t, "s": s_t, "b": b_t, "dy": dy_t})
    leaves = [t.clone().requires_grad_() for t in (x_t, s_t, b_t)]
    out = F.layer_norm(leaves[0], (10,), leaves[1].flatten(), leaves[2].flatten())
    close(refs[y.name], out)
    for got, want in zip((dx, ds, db), torch.autograd.grad(out, leaves, dy_t)):
        close(refs[got.name], want, 1e-8)
    leaves = [t.clone().requires_grad_() for t in (x_t, s_t, b_t)]
    rms = leaves[0] * (leaves[0].square().mean(-1, keepdim=True) + 1e-5).rsqrt() * leaves[1] + leaves[2]
    close(refs[ry.name], rms)
    for got, want in zip((rdx, rds, rdb), torch.autograd.grad(rms, leaves, dy_t)):
        close(refs[got.name], want, 1e-8)


@pytest.mark.parametrize("op", ["batchnorm", "instancenorm", "groupnorm"])
def test_channel_norm_backward_against_autograd(op):
    torch.manual_seed(3)
    x_t = torch.randn(2, 4, 3, 5, dtype=torch.float64) * 2 - 1
    s_t, b_t = torch.randn(1, 4, 1, 1, dtype=torch.float64), torch.randn(1, 4, 1, 1, dtype=torch.float64)
    dy_t = torch.randn_like(x_t)
    g = dg.Graph()
    x, s, b, dy = (g.tensor_like(t.float(), n) for t, n in ((x_t, "x"), (s_t, "s"), (b_t, "b"), (dy_t, "dy")))
    extra = {"groups": 2} if op == "groupnorm" else {}
    y, mean, inv = getattr(g, op)(x, s, b, **extra)[:3]
    grads = getattr(g, op + "_backward")(dy, x, s, mean, inv, **extra)
    for t in grads:
        t.set_output(True)
    y.set_output(True)
    refs = g.reference({"x": x_t, "s": s_t, "b": b_t, "dy": dy_t})
    leaves = [t.clone().requires_grad_() for t in (x_t, s_t, b_t)]
    fwd = {"batchnorm": lambda a, w, c: F.batch_norm(a, None, None, w.flatten(), c.flatten(), training=True),
           "instancenorm": lambda a, w, c: F.instance_norm(a, weight=w.flatten(), bias=c.flatten()),
           "groupnorm": lambda a, w, c: F.group_norm(a, 2, w.flatten(), c.flatten())}[op]
    out = fwd(*leaves)
    close(refs[y.name], out)
    for got, want in zip(grads, torch.autograd.grad(out, leaves, dy_t)):
        close(refs[got.name], want, 1e-8)


@pytest.mark.parametrize("log", [False, True])
def test_softmax_and_backward(log):
    x_t = torch.randn(5, 9, dtype=torch.float64)
    dy_t = torch.randn(5, 9, dtype=torch.float64)
    g = dg.Graph()
    x, dy = g.tensor_like(x_t.float(), "x"), g.tensor_like(dy_t.float(), "dy")
    y = g.softmax(x, axis=-1, log=log).set_output(True)
    dx = g.softmax_backward(dy, y, axis=-1, log=log).set_output(True)
    refs = g.reference({"x": x_t, "dy": dy_t})
    leaf = x_t.clone().requires_grad_()
    out = (torch.log_softmax if log else torch.softmax)(leaf, -1)
    close(refs[y.name], out)
    close(refs[dx.name], torch.autograd.grad(out, leaf, dy_t)[0])


@pytest.mark.parametrize("causal,gqa,pad", [(False, False, False), (True, True, False), (False, True, True)])
def test_sdpa_forward_backward(causal, gqa, pad):
    torch.manual_seed(4)
    q_t = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    kv_heads = 2 if gqa else 4
    k_t, v_t = torch.randn(2, kv_heads, 6, 8, dtype=torch.float64), torch.randn(2, kv_heads, 6, 8, dtype=torch.float64)
    g = dg.Graph()
    q, k, v = (g.tensor_like(t.float(), n) for t, n in ((q_t, "q"), (k_t, "k"), (v_t, "v")))
    lens = g.tensor(name="lens", dim=[2, 1, 1, 1], data_type=dg.int32) if pad else None
    o, stats = g.sdpa(q, k, v, is_inference=False, use_causal_mask=causal, seq_len_kv=lens)
    o.set_output(True)
    stats.set_output(True)
    bind = {"q": q_t, "k": k_t, "v": v_t}
    lens_t = torch.tensor([6, 3], dtype=torch.int32).view(2, 1, 1, 1)
    if pad:
        bind["lens"] = lens_t
    refs = g.reference(bind)
    mask = None
    if pad:
        mask = (torch.arange(6).view(1, 1, 1, 6) < lens_t.view(2, 1, 1, 1))
    expected = F.scaled_dot_product_attention(q_t, k_t.repeat_interleave(4 // kv_heads, 1),
                                              v_t.repeat_interleave(4 // kv_heads, 1),
                                              attn_mask=mask, is_causal=causal)
    close(refs[o.name], expected)
    assert refs[stats.name].shape == (2, 4, 6, 1)


def test_pooling_dropout_reduction_and_layout_ops():
    x_t = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    g = dg.Graph()
    x = g.tensor_like(x_t.float(), "x")
    p = g.pooling(x, "avg_exclude_pad", [3, 3], [2, 2], [1, 1]).set_output(True)
    d = g.dropout(x, p=0.25, seed=7, offset=11).set_output(True)
    r = g.reduction(x, "norm2", [1, 3]).set_output(True)
    s = g.slice(x, [slice(None), slice(0, 2), slice(1, 8, 3), slice(None)]).set_output(True)
    c = g.concatenate([x, x], axis=1).set_output(True)
    refs = g.reference({"x": x_t})
    close(refs[p.name], F.avg_pool2d(x_t, 3, 2, 1, count_include_pad=False))
    close(refs[r.name], x_t.square().sum((1, 3), keepdim=True).sqrt())
    assert refs[s.name].shape == (2, 2, 3, 9) and refs[c.name].shape == (2, 6, 9, 9)
    kept = refs[d.name] != 0
    assert 0.6 < kept.double().mean() < 0.9
    close(refs[d.name][kept], x_t[kept] / 0.75)
    again = g.reference({"x": x_t})[d.name]
    assert torch.equal(again, refs[d.name]), "same seed and offset, same mask"


def test_pointwise_backward_forms_match_autograd():
    x_t, dy_t = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    g = dg.Graph()
    x, dy = g.tensor_like(x_t.float(), "x"), g.tensor_like(dy_t.float(), "dy")
    out = g.gelu_tanh_backward(dy, x).set_output(True)
    leaf = x_t.clone().requires_grad_()
    want = torch.autograd.grad(F.gelu(leaf, approximate="tanh"), leaf, dy_t)[0]
    close(g.reference({"x": x_t, "dy": dy_t})[out.name], want)
