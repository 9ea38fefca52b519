"""JSON round trip over the whole catalog, and rejection of bad documents."""
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dnngraph as dg
from dnngraph.ops import REGISTRY
from dnngraph.serialization import SCHEMA_VERSION
from dnngraph.ops.pointwise import POINTWISE_OPS


def build_family_ops(g, n, c, size, draw_int):
    """One call of every non-pointwise op of the catalog, sized by the drawn numbers."""
    x = g.tensor(name="x", dim=[n, c, size, size])
    s = g.tensor(name="s", dim=[1, c, 1, 1])
    b = g.tensor(name="b", dim=[1, c, 1, 1])
    w = g.tensor(name="w", dim=[c, 1, 3, 3])
    feat_s = g.tensor(name="fs", dim=[1, 1, 1, size])
    y = g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=c)
    g.conv_dgrad(y, w, x_dim=[n, c, size, size], padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=c)
    g.conv_wgrad(y, x, w_dim=[c, 1, 3, 3], padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=c,
                 mode="convolution")
    g.matmul(x, g.tensor(name="m", dim=[size, 3]))
    g.reduction(x, "norm2", [1, 3])
    sm = g.softmax(x, axis=draw_int(0, 3), log=True)
    g.softmax_backward(x, sm, axis=1)
    ln = g.layernorm(x, feat_s, feat_s, epsilon=1e-3)
    g.layernorm_backward(x, x, feat_s, ln[1], ln[2])
    rm = g.rmsnorm(x, feat_s, norm_forward_phase="inference")
    rt = g.rmsnorm(x, feat_s)
    g.rmsnorm_backward(x, x, feat_s, rt[1], has_dbias=True)
    per_sample = g.tensor(name="ada_s", dim=[n, 1, 1, size])
    epsilon = g.tensor(name="eps", dim=[1, 1, 1, 1], is_pass_by_value=True)
    ada = g.adalayernorm(x, per_sample, per_sample, epsilon=epsilon)
    g.adalayernorm_backward(x, x, per_sample, ada[1], ada[2])
    bn = g.batchnorm(x, s, b, s, b, momentum=0.2)
    g.batchnorm_backward(x, x, s, bn[1], bn[2])
    g.batchnorm_inference(x, s, b, s, b)
    inn = g.instancenorm(x, s, b)
    g.instancenorm_backward(x, x, s, inn[1], inn[2])
    gn = g.groupnorm(x, s, b, groups=1)
    g.groupnorm_backward(x, x, s, gn[1], gn[2], groups=1)
    g.genstats(x)
    g.pooling(x, "max", [2, 2], [1, 1], [1, 1])
    g.pooling_backward(g.pooling(x, "avg_include_pad", [3, 3], [2, 2], [1, 1]), x, "avg_include_pad", [3, 3], [2, 2], [1, 1])
    g.pooling(x, "avg_exclude_pad", [2, 2], [2, 2], [1, 1], ceil_mode=True, divisor=draw_int(1, 9))
    ids = g.tensor(name="ids", dim=[n, c, 1, size], data_type=dg.int64)
    g.scatter_add(g.gather(x, ids, 2), ids, 2, size)
    tokens = g.tensor(name="tokens", dim=[size + 1, c])
    first_token_offset = g.tensor(name="first_token_offset", dim=[2], data_type=dg.int32)
    routed = g.moe_grouped_matmul(tokens, g.tensor(name="experts", dim=[2, c, 3]), first_token_offset,
                                  allow_tf32=bool(draw_int(0, 1)))
    g.moe_grouped_matmul_wgrad(tokens, routed, first_token_offset)
    # the recurrence and its backward: an lstm over xw [steps, batch, 4 * hidden]
    xw, h0 = g.tensor(name="xw", dim=[size, n, 4 * c]), g.tensor(name="h0", dim=[n, c])
    w_hh, lengths = g.tensor(name="w_hh", dim=[4 * c, c]), g.tensor(name="lengths", dim=[n], data_type=dg.int32)
    _, h_n, c_n, h_prev, c_prev, _ = g.rnn_recurrence(xw, h0, h0, w_hh, None, None, lengths, mode="lstm",
                                                      reverse=bool(draw_int(0, 1)))
    g.rnn_recurrence_backward(xw, w_hh, None, None, lengths, h_prev, c_prev, None, h_n, c_n, mode="lstm")
    g.dropout(x, p=0.1, seed=draw_int(0, 2**40), offset=3, return_mask=True)
    log_probs = g.tensor(name="log_probs", dim=[size, n, c + 1])
    labels = [g.tensor(name=name, dim=dims, data_type=dg.int32) for name, dims in
              (("labels", [n, 2]), ("frames", [n]), ("label_lengths", [n]))]
    ctc = g.ctc_loss(log_probs, *labels, blank=draw_int(0, c), reduction="none", zero_infinity=bool(draw_int(0, 1)))
    g.ctc_loss_backward(log_probs, *labels, ctc, blank=0, reduction="none")
    q = g.tensor(name="q", dim=[n, 2, size, 4])
    o, stats = g.sdpa(q, q, q, attn_scale=0.5, is_inference=False, use_causal_mask=True,
                      bias=g.tensor(name="bias", dim=[1, 1, size, size]), dropout=(0.1, 5, 6))
    g.sdpa_backward(q, q, q, o, o, stats, use_causal_mask=True)
    g.sdpa_backward(q, q, q, o, o, stats, bias=g.tensor(name="rel_bias", dim=[1, 2, size, size]),
                    compute_dbias=True)
    g.reshape(x, [n * c, size * size])
    g.transpose(x, [0, 2, 3, 1])
    g.slice(x, [slice(None), slice(0, 1), slice(None), slice(0, size, 2)])
    g.concatenate([x, x], axis=1)
    lrn_size = draw_int(1, 5)
    g.lrn_backward(g.lrn(x, lrn_size, alpha=0.5, beta=0.75, k=2.0), x, lrn_size, alpha=0.5, beta=0.75, k=2.0)
    g.divisive_normalization_backward(g.divisive_normalization(x, 3, means=s), x, 3, means=b, k=0.5)
    blocks = g.tensor(name="blocks", dim=[n, 32 * draw_int(1, 2)])
    quantized, scale = g.block_scale_quantize(blocks, block_size=32 // draw_int(1, 2), axis=-1)
    g.block_scale_dequantize(quantized, scale, block_size=[1, quantized.dim[-1] // scale.dim[-1]])
    q8 = g.tensor(name="q8", dim=[n, 2, size, 16], data_type=dg.float8_e4m3)
    fp8_scales = [g.tensor(name=f"fp8_scale_{i}", dim=[1, 1, 1, 1], data_type=dg.float32) for i in range(12)]
    o8, stats8, _, _ = g.sdpa_fp8(q8, q8, q8, *fp8_scales[:6], is_inference=False,
                                  use_causal_mask=bool(draw_int(0, 1)))
    g.sdpa_fp8_backward(q8, q8, q8, o8, o8, stats8, *fp8_scales, attn_scale=0.5)


@st.composite
def catalog_graphs(draw):
    g = dg.Graph(name="random", io_data_type=draw(st.sampled_from([dg.float16, dg.bfloat16, dg.float32])))
    n, c, size = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(3, 6))
    build_family_ops(g, n, c, size, lambda lo, hi: draw(st.integers(lo, hi)))
    x = g.tensor_by_name("x")
    values = [x]
    for op in draw(st.lists(st.sampled_from(sorted(POINTWISE_OPS)), min_size=1, max_size=12)):
        entry = POINTWISE_OPS[op]
        operands = [draw(st.sampled_from(values)) if draw(st.booleans()) or i == 0 else draw(st.floats(-3, 3))
                    for i in range(entry.arity)]
        kwargs = {"data_type": draw(st.sampled_from([dg.float16, dg.int32, dg.bool]))} if op == "cast" else {}
        if "negative_slope" in entry.params:
            kwargs["negative_slope"] = draw(st.floats(0, 1))
        if "axis" in entry.params:  # gen_index: the index along one of its operand's axes
            kwargs["axis"] = draw(st.integers(0, len(operands[0].dim) - 1 if isinstance(operands[0], dg.Tensor) else 0))
        values.append(getattr(g, op)(*operands, **kwargs))
    for t in g.tensors:
        if t.producer is not None and draw(st.booleans()):
            t.set_output(True)
    values[-1].set_output(True).set_data_type(dg.float32)
    return g


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalog_graphs())
def test_round_trip_preserves_everything(g):
    text = g.to_json()
    again = dg.Graph.from_json(text)
    assert dg.Graph.from_json(again.to_json()).to_json() == again.to_json()  # a fixed point
    assert [(n.op, n.name, n.attrs) for n in again.nodes] == [(n.op, n.name, n.attrs) for n in g.nodes]
    def described(graph):
        return {t.name: (t.dim, t.stride, t.data_type, t.is_output, t.producer and t.producer.name)
                for t in graph.tensors}
    assert described(again) == described(g)


def test_catalog_is_covered_by_the_round_trip_graph():
    g = dg.Graph()
    build_family_ops(g, 2, 2, 4, lambda lo, hi: lo)
    used = {n.op for n in g.nodes} | set(POINTWISE_OPS)
    assert used == set(REGISTRY)


def test_round_tripped_graph_builds_and_executes():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[5, 7])
    g.softplus(g.mul(x, 2.0), beta=2.0).set_output(True).set_name("y")
    again = dg.Graph.from_json(g.to_json())
    again.build()
    x_t, y_t = torch.randn(5, 7), torch.full((5, 7), float("nan"))
    again.execute({"x": x_t, "y": y_t})
    assert torch.allclose(y_t, torch.nn.functional.softplus(2 * x_t, beta=2.0), atol=1e-6)


def _doc():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[2, 3])
    g.exp(g.relu(x)).set_output(True)
    return json.loads(g.to_json())


def _mutations():
    def cycle(d):
        d["nodes"][0]["inputs"] = [d["nodes"][1]["outputs"][0]]
    return {
        "truncated": lambda d: json.dumps(d)[:40],
        "not an object": lambda d: "[1, 2]",
        "wrong format": lambda d: {**d, "format": "other"},
        "newer version": lambda d: {**d, "version": SCHEMA_VERSION + 1},
        "unknown op": lambda d: d["nodes"][0].update(op="conv9d"),
        "unknown attribute": lambda d: d["nodes"][0]["attrs"].update(bogus=1),
        "bad attribute value": lambda d: d["nodes"][0]["attrs"].update(data_type="float128"),
        "dangling reference": lambda d: d["nodes"][1].update(inputs=[999]),
        "cycle": cycle,
        "missing tensors": lambda d: d.pop("tensors"),
        "bad dims": lambda d: d["tensors"][0].update(dim=[2, -3]),
        "wrong output count": lambda d: d["nodes"][0].update(outputs=[]),
        "bad data type": lambda d: d["graph"].update(io_data_type="complex"),
    }


@pytest.mark.parametrize("name", sorted(_mutations()))
def test_bad_documents_raise_serialization_error(name):
    doc = _doc()
    result = _mutations()[name](doc)
    text = result if isinstance(result, str) else json.dumps(result if isinstance(result, dict) else doc)
    with pytest.raises(dg.SerializationError):
        dg.Graph.from_json(text)


def test_loading_never_evaluates_code():
    doc = _doc()
    doc["nodes"][0]["attrs"]["data_type"] = "__import__('os').system('false')"
    with pytest.raises(dg.SerializationError):
        dg.Graph.from_json(json.dumps(doc))


def test_round_trip_keeps_the_uids_of_inputs_declared_after_nodes():
    """Inputs declared after some node (a bias, a blend factor set on an output already made)
    keep their uids and their place among the nodes' tensors: the document read back is the
    document written, and a plan's groups (fingerprinted by uid) match the reloaded graph's."""
    g = dg.Graph()
    x = g.tensor(name="x", dim=[3, 5])
    y = g.exp(x)
    b = g.tensor(name="b", dim=[3, 5])
    z = g.add(y, b).set_output(True).set_name("z")
    alpha = g.tensor(name="alpha", dim=[1])
    z.set_blend(alpha=alpha, beta=1.0)
    again = dg.Graph.from_json(g.to_json())
    assert json.loads(again.to_json()) == json.loads(g.to_json())
    assert [(t.uid, t.name) for t in again.tensors] == [(t.uid, t.name) for t in g.tensors]
