"""A fixed set of graphs, one or more per kernel family, at the sizes the benchmarks time on the
H100 (tests/backends/test_target.py builds them for a target and compares the configs chosen).
Nothing here executes: a build picks configs and writes kernel sources only."""
import dnngraph as dg

BF16 = dict(io_data_type=dg.bfloat16, intermediate_data_type=dg.float32, compute_data_type=dg.float32)


def _graph(name, **types):
    return dg.Graph(name=name, **(types or BF16))


def _nhwc(dim):
    n, c, h, w = dim
    return [c * h * w, 1, w * c, c]


def matmul(m, n, k, batch=(), epilogue="bias_gelu", dtype=dg.bfloat16, allow_tf32=False):
    types = dict(io_data_type=dtype, intermediate_data_type=dg.float32, compute_data_type=dg.float32)
    g = dg.Graph(name=f"mm{m}x{n}x{k}", allow_tf32=allow_tf32, **types)
    a = g.tensor(name="a", dim=[*batch, m, k])
    b = g.tensor(name="b", dim=[*batch, k, n])
    c = g.matmul(a, b)
    if epilogue == "bias_gelu":
        bias = g.tensor(name="bias", dim=[*([1] * len(batch)), 1, n])
        c = g.gelu(g.add(c, bias))
    elif epilogue == "silu_backward":  # a Llama MLP backward's wide epilogue: reads two, writes two
        gate, up = (g.tensor(name=name, dim=[*batch, m, n]) for name in ("gate", "up"))
        d_up = g.mul(c, g.silu(gate)).set_output(True).set_name("d_up")
        c = g.mul(g.silu_backward(g.mul(c, up), gate), up)
        assert d_up is not None
    c.set_output(True).set_name("c")
    return g


def mixed_matmul(m, n, k):
    g = _graph("mixed")
    a = g.tensor(name="a", dim=[m, k], data_type=dg.float32)
    b = g.tensor(name="b", dim=[k, n])
    g.matmul(a, b).set_output(True).set_name("c")
    return g


def conv(n, c, k, size, kernel, stride=1, padding=0, groups=1, op="fprop"):
    g = _graph(f"conv_{op}")
    out = (size + 2 * padding - kernel) // stride + 1
    x_dim, w_dim, y_dim = [n, c, size, size], [k, c // groups, kernel, kernel], [n, k, out, out]
    geometry = dict(padding=[padding] * 2, stride=[stride] * 2, dilation=[1, 1], groups=groups)
    w = g.tensor(name="w", dim=w_dim)
    if op == "fprop":
        x = g.tensor(name="x", dim=x_dim, stride=_nhwc(x_dim))
        bias = g.tensor(name="bias", dim=[1, k, 1, 1])
        y = g.relu(g.add(g.conv_fprop(x, w, **geometry), bias))
        y.set_output(True).set_name("y").set_stride(_nhwc(y_dim))
    elif op == "dgrad":
        dy = g.tensor(name="dy", dim=y_dim, stride=_nhwc(y_dim))
        g.conv_dgrad(dy, w, x_dim, **geometry).set_output(True).set_name("dx").set_stride(_nhwc(x_dim))
    else:
        dy = g.tensor(name="dy", dim=y_dim, stride=_nhwc(y_dim))
        x = g.tensor(name="x", dim=x_dim, stride=_nhwc(x_dim))
        g.conv_wgrad(dy, x, w_dim, **geometry).set_output(True).set_name("dw")
    return g


def conv_batchnorm_stats(n, c, k, size):
    """A 3x3 conv whose per-channel sums ride as an exit (the column fold)."""
    g = _graph("conv_stats")
    x_dim = [n, c, size, size]
    x = g.tensor(name="x", dim=x_dim, stride=_nhwc(x_dim))
    w = g.tensor(name="w", dim=[k, c, 3, 3])
    y = g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1]).set_output(True).set_name("y")
    y.set_stride(_nhwc([n, k, size, size]))
    g.reduction(y, mode="sum", axes=[0, 2, 3]).set_output(True).set_name("sums")
    return g


def layernorm(rows, hidden, backward=False):
    g = _graph("layernorm")
    x = g.tensor(name="x", dim=[rows, hidden])
    scale, bias = (g.tensor(name=name, dim=[1, hidden], data_type=dg.float32) for name in ("scale", "bias"))
    if not backward:
        y, mean, inv = g.layernorm(x, scale, bias)
        for tensor, name in ((y, "y"), (mean, "mean"), (inv, "inv")):
            tensor.set_output(True).set_name(name)
        return g
    dy = g.tensor(name="dy", dim=[rows, hidden])
    mean, inv = (g.tensor(name=name, dim=[rows, 1], data_type=dg.float32) for name in ("mean", "inv"))
    for tensor, name in zip(g.layernorm_backward(dy, x, scale, mean, inv), ("dx", "dscale", "dbias")):
        tensor.set_output(True).set_name(name)
    return g


def softmax(rows, cols):
    g = _graph("softmax")
    x = g.tensor(name="x", dim=[rows, cols])
    g.softmax(x).set_output(True).set_name("y")
    return g


def batchnorm(n, c, size, backward=False):
    g = _graph("batchnorm")
    dim = [n, c, size, size]
    x = g.tensor(name="x", dim=dim, stride=_nhwc(dim))
    scale, bias = (g.tensor(name=name, dim=[1, c, 1, 1], data_type=dg.float32) for name in ("scale", "bias"))
    if not backward:
        y, mean, inv, _, _ = g.batchnorm(x, scale, bias)
        y.set_output(True).set_name("y").set_stride(_nhwc(dim))
        mean.set_output(True).set_name("mean")
        inv.set_output(True).set_name("inv")
        return g
    dy = g.tensor(name="dy", dim=dim, stride=_nhwc(dim))
    mean, inv = (g.tensor(name=name, dim=[1, c, 1, 1], data_type=dg.float32) for name in ("mean", "inv"))
    dx, dscale, dbias = g.batchnorm_backward(dy, x, scale, mean, inv)
    dx.set_output(True).set_name("dx").set_stride(_nhwc(dim))
    dscale.set_output(True).set_name("dscale")
    dbias.set_output(True).set_name("dbias")
    return g


def column_sum(rows, cols):
    g = _graph("colsum")
    x = g.tensor(name="x", dim=[rows, cols])
    g.reduction(x, mode="sum", axes=[0]).set_output(True).set_name("sums")
    return g


def sdpa(b, h, s_q, s_kv, d, h_kv=None, causal=False, backward=False):
    g = _graph("sdpa")
    h_kv = h_kv or h
    q = g.tensor(name="q", dim=[b, h, s_q, d])
    k, v = (g.tensor(name=name, dim=[b, h_kv, s_kv, d]) for name in ("k", "v"))
    if not backward:
        g.sdpa(q, k, v, use_causal_mask=causal)[0].set_output(True).set_name("o")
        return g
    o, d_o = (g.tensor(name=name, dim=[b, h, s_q, d]) for name in ("o", "dO"))
    stats = g.tensor(name="stats", dim=[b, h, s_q, 1], data_type=dg.float32)
    for grad, name in zip(g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=causal), ("dq", "dk", "dv")):
        grad.set_output(True).set_name(name)
    return g


def softcap_attention(b, h, s, d, cap=50.0):
    """Attention written as ops with a tanh softcap (an op-level chain)."""
    g = _graph("softcap")
    q = g.tensor(name="q", dim=[b, h, s, d])
    k, v = (g.tensor(name=name, dim=[b, h, s, d]) for name in ("k", "v"))
    scores = g.matmul(q, g.transpose(k, [0, 1, 3, 2]))
    scores = g.scale(g.tanh(g.scale(scores, 1.0 / cap)), cap)
    g.matmul(g.softmax(scores, axis=-1), v).set_output(True).set_name("o")
    return g


def pointwise(rows, cols):
    g = _graph("pointwise")
    x = g.tensor(name="x", dim=[rows, cols])
    bias = g.tensor(name="bias", dim=[1, cols])
    g.relu(g.add(x, bias)).set_output(True).set_name("y")
    return g


def pooling(n, c, size):
    g = _graph("pooling")
    dim = [n, c, size, size]
    x = g.tensor(name="x", dim=dim, stride=_nhwc(dim))
    y = g.pooling(x, mode="max", window=[3, 3], stride=[2, 2], padding=[1, 1])
    y.set_output(True).set_name("y")
    return g


def depthwise(n, c, size, op="fprop"):
    return conv(n, c, c, size, 3, padding=1, groups=c, op=op)


PROBLEMS = {
    "matmul 4096^3 bias gelu": lambda: matmul(4096, 4096, 4096),
    "matmul 8192^3 bias gelu": lambda: matmul(8192, 8192, 8192),
    "matmul decode 1x11008x4096": lambda: matmul(1, 11008, 4096, epilogue=""),
    "matmul 128x128x16384 split": lambda: matmul(128, 128, 16384, epilogue=""),
    "matmul 4096x14336x4096 silu backward": lambda: matmul(4096, 14336, 4096, epilogue="silu_backward"),
    "matmul fp32 2048^3": lambda: matmul(2048, 2048, 2048, epilogue="", dtype=dg.float32),
    "matmul tf32 2048^3": lambda: matmul(2048, 2048, 2048, epilogue="", dtype=dg.float32, allow_tf32=True),
    "bmm 16x512x512x64": lambda: matmul(512, 512, 64, batch=(16,), epilogue=""),
    "matmul fp32 x bf16 2048x4096x4096": lambda: mixed_matmul(2048, 4096, 4096),
    "conv 3x3 256@14 N32": lambda: conv(32, 256, 256, 14, 3, padding=1),
    "conv 3x3 64@56 N32": lambda: conv(32, 64, 64, 56, 3, padding=1),
    "conv stem 7x7 s2 N32": lambda: conv(32, 3, 64, 224, 7, stride=2, padding=3),
    "conv 1x1 256->64 @56 N32": lambda: conv(32, 256, 64, 56, 1),
    "conv dgrad 3x3 s2 128@28 N32": lambda: conv(32, 128, 128, 56, 3, stride=2, padding=1, op="dgrad"),
    "conv wgrad 3x3 64@56 N32": lambda: conv(32, 64, 64, 56, 3, padding=1, op="wgrad"),
    "conv wgrad stem N32": lambda: conv(32, 3, 64, 224, 7, stride=2, padding=3, op="wgrad"),
    "conv + channel sums 64@56 N32": lambda: conv_batchnorm_stats(32, 64, 64, 56),
    "depthwise fprop 3x3 256@56 N32": lambda: depthwise(32, 256, 56),
    "depthwise wgrad 3x3 256@56 N32": lambda: depthwise(32, 256, 56, op="wgrad"),
    "layernorm 16384x8192": lambda: layernorm(16384, 8192),
    "layernorm backward 4096x4096": lambda: layernorm(4096, 4096, backward=True),
    "layernorm backward 4096x14336": lambda: layernorm(4096, 14336, backward=True),
    "softmax 4096x32768": lambda: softmax(4096, 32768),
    "softmax 64x262144": lambda: softmax(64, 262144),
    "batchnorm NHWC 32x256x56x56": lambda: batchnorm(32, 256, 56),
    "batchnorm backward NHWC 32x256x56x56": lambda: batchnorm(32, 256, 56, backward=True),
    "column sum 100352x64": lambda: column_sum(100352, 64),
    "sdpa D128 B4 H32 S4096 causal": lambda: sdpa(4, 32, 4096, 4096, 128, causal=True),
    "sdpa D64 B8 H16 S2048": lambda: sdpa(8, 16, 2048, 2048, 64),
    "sdpa D256 B2 H16 S4096": lambda: sdpa(2, 16, 4096, 4096, 256),
    "sdpa decode B64 H32:8 Skv8192 D128": lambda: sdpa(64, 32, 1, 8192, 128, h_kv=8),
    "sdpa decode B2 H32:8 Skv8192 D128": lambda: sdpa(2, 32, 1, 8192, 128, h_kv=8),
    "sdpa backward D128 B4 H32 S4096 causal": lambda: sdpa(4, 32, 4096, 4096, 128, causal=True, backward=True),
    "softcap attention B4 H16 S2048 D128": lambda: softcap_attention(4, 16, 2048, 128),
    "pointwise 16384x8192": lambda: pointwise(16384, 8192),
    "max pooling 3x3 s2 64@112 N32": lambda: pooling(32, 64, 112),
}


def chosen_configs(build) -> dict:
    """Problem name -> [config text of each launch] of every graph above, built by build(g)."""
    chosen = {}
    for name, make in PROBLEMS.items():
        g = make()
        build(g)
        chosen[name] = [launch.config_text for launch in g.plan.launches]
    return chosen
