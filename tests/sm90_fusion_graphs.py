"""Graphs whose kernels the GPU compiler must accept (for tests/sm90_compile.py): the fusions a
Llama layer through the torch backend makes (epilogues across a Linear's views, folded batches,
attention storing into the layout a reshape needs), built with an H100's configs (persistent
GEMMs with descriptors, the GPU attention tiles)."""
import dnngraph as dg

H100 = dg.BuildOptions(target=dg.target.H100)

S, H, HEADS = 1024, 1024, 8


def _graph(name):
    return dg.Graph(name=name, io_data_type=dg.bfloat16, intermediate_data_type=dg.float32,
                    compute_data_type=dg.float32)


def llama_fusions():
    """(label, built graph) of each fusion, its configs chosen for an H100."""
    g = _graph("residual_and_variance")
    x, w, r = g.tensor(name="x", dim=[1, S, H]), g.tensor(name="w", dim=[H, H]), g.tensor(name="r", dim=[1, S, H])
    y = g.add(r, g.matmul(x, w)).set_output(True).set_name("y")
    g.reduction(g.pow(g.cast(y, data_type=dg.float32), 2.0), "sum", [2]).set_output(True).set_name("ss")
    yield "o_proj + residual + variance exit", g.build(options=H100)

    g = _graph("swiglu")
    h = g.tensor(name="h", dim=[1, S, H])
    wg, wu = g.tensor(name="wg", dim=[H, 2 * H]), g.tensor(name="wu", dim=[H, 2 * H])
    gate = g.matmul(h, wg)
    g.mul(g.silu(gate), g.matmul(h, wu)).set_output(True).set_name("p")
    yield "gate/up + silu * up", g.build(options=H100)

    g = _graph("folded")
    x, w, r = g.tensor(name="x", dim=[4, S // 4, H]), g.tensor(name="w", dim=[H, H]), g.tensor(name="r", dim=[4, S // 4, H])
    g.add(g.matmul(x, w), r).set_output(True).set_name("y")
    g.reshape(g.matmul(x, w).set_data_type(dg.bfloat16), [S, H]).set_output(True).set_name("saved")
    yield "batches folded into rows", g.build(options=H100)

    g = _graph("attention_bshd")
    q, k, v = (g.tensor(name=n, dim=[1, S, HEADS, H // HEADS]) for n in ("q", "k", "v"))
    dO = g.tensor(name="dO", dim=[1, HEADS, S, H // HEADS])
    q, k, v = (g.transpose(t, [0, 2, 1, 3]) for t in (q, k, v))
    o, stats = g.sdpa(q, k, v, is_inference=False, use_causal_mask=True)
    o.set_data_type(dg.bfloat16)
    g.matmul(g.reshape(g.transpose(o, [0, 2, 1, 3]), [1, S, H]), g.tensor(name="wo", dim=[H, H])).set_output(True)
    dq, dk, dv = g.sdpa_backward(q, k, v, o, dO, stats, use_causal_mask=True)
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):  # typed as the backend types them
        grad.set_data_type(dg.bfloat16)
        g.reshape(g.transpose(grad, [0, 2, 1, 3]), [1, S, H]).set_output(True).set_name(name)
    yield "attention writing BSHD", g.build(options=H100)
