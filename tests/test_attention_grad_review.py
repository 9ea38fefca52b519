"""Adversarial review of the op-level attention backward (autodiff chain recompute, the
attention_backward matcher, its kernels): gradients through Graph.as_function against torch
autograd on the float64 reference, hand-written backwards against g.reference.

Tests that fail on the reviewed commit name the defect in their docstring; the rest are
regression tests for cases that held up."""
import pytest
import torch

import dnngraph as dg
from dnngraph.fusion import partition
from helpers import poisoned
from test_attention_grad import _check, _close

GEN = torch.Generator().manual_seed(5)


def _rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


def _as_function_check(inputs, body, wanted, tolerance=2e-5, io=dg.float32):
    """Build `body(g, tensors)` (its result is the output "out"), differentiate it through
    as_function and compare the output and the wanted gradients with torch autograd on the
    float64 reference. Returns the kinds of the backward launches."""
    g = dg.Graph(name="review", io_data_type=io, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    t = {name: g.tensor_like(value, name) for name, value in inputs.items()}
    body(g, t).set_output(True).set_name("out")
    derivation = _check(g, inputs, wanted, tolerance)
    return [launch.group.kind for launch in derivation.backward.plan.launches]


def _hand_check(inputs, body, tolerance=1e-5):
    """Build the hand-written graph `body(g, tensors)` (a dict of named outputs), execute it with
    poisoned outputs and compare with g.reference in float64. Returns the partition's kinds."""
    g = dg.Graph(name="hand", intermediate_data_type=dg.float32)
    t = {name: g.tensor_like(value, name) for name, value in inputs.items()}
    for name, tensor in body(g, t).items():
        tensor.set_output(True).set_name(name)
    kinds = [group.kind for group in partition(g)]
    g._restore_strides()
    g.build()
    results = {x.name: poisoned(x) for x in g.outputs()}
    g.execute({**inputs, **results})
    ref = g.reference({n: v.double() if v.is_floating_point() else v for n, v in inputs.items()})
    for name, value in results.items():
        _close(value, ref[name], tolerance, name)
    return kinds


def _swap(g, x):
    return g.transpose(x, list(range(len(x.dim) - 2)) + [len(x.dim) - 1, len(x.dim) - 2])


def _chain(score=None, dropout=None, scale=0.4):
    def body(g, t):
        s = g.mul(g.matmul(t["q"], t["kt"]), scale)
        if score is not None:
            s = score(g, t, s)
        probs = g.softmax(s)
        if dropout is not None:
            probs = g.dropout(probs, dropout, 99, 3)
        return g.matmul(probs, t["v"])
    return body


ALL = ("q", "kt", "v")


# --- defects -------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_lead, v_lead", [((1, 3), (2, 3)), ((2, 1), (2, 3))])
def test_values_broadcasting_past_the_probabilities(q_lead, v_lead):
    """DEFECT (autodiff.chain_softmax_backward): q and k^T shared over the batch (or the heads),
    v not: o = p v has more batches than p, so delta = rowsum(o * dO) is per batch while dP is
    summed over the batch by `fit`; the derived softmax gradient sum_b p (dP_sum - delta_b)
    counts p dP_sum once per batch. Observed: dq and dk off by relative error > 1."""
    inputs = {"q": _rnd(*q_lead, 9, 5), "kt": _rnd(*q_lead, 5, 11), "v": _rnd(*v_lead, 11, 7)}
    _as_function_check(inputs, _chain(), ALL)


def test_values_broadcasting_past_the_probabilities_dv_only():
    """DEFECT (fusion/attention.py + plan/attention.py): with only v wanted, dv = matmul(p^T, dO)
    has dO's batch (2) but the group's grid takes the batch of the scores (1): the kernel writes
    dv of batch 0 only and the rest is workspace garbage (observed rel err ~1e37)."""
    inputs = {"q": _rnd(1, 3, 9, 5), "kt": _rnd(1, 3, 5, 11), "v": _rnd(2, 3, 11, 7)}
    _as_function_check(inputs, _chain(), ("v",))


@pytest.mark.parametrize("lead_q, lead_do", [((1, 2), (3, 2)), ((2, 1), (2, 3)), ((1,), (3,))])
def test_hand_written_dv_wider_than_the_scores_is_not_fused(lead_q, lead_do):
    """DEFECT (matcher): dv = matmul(transpose(softmax(q kT)), dO) with dO broader than the
    scores (batch, heads, or the rank-3 batch) is fused; dv is left unwritten (NaN poison) past
    the scores' first batch/head."""
    inputs = {"q": _rnd(*lead_q, 9, 5), "kt": _rnd(*lead_q, 5, 11), "do": _rnd(*lead_do, 9, 7)}

    def body(g, t):
        p = g.softmax(g.mul(g.matmul(t["q"], t["kt"]), 0.5))
        return {"dv": g.matmul(_swap(g, p), t["do"])}
    _hand_check(inputs, body)


def test_gradient_op_reading_the_dv_product_is_not_fused():
    """DEFECT (matcher, closed()): a gradient op reads the group's own dV product (dims equal to
    the scores when Sq = Skv = Dv); the product is treated as a side and loaded from memory by
    the dK/dV kernel while that kernel is still writing it. Observed: dk all NaN (poison)."""
    s = 8
    inputs = {"q": _rnd(1, 2, s, 5), "kt": _rnd(1, 2, 5, s), "v": _rnd(1, 2, s, s), "o": _rnd(1, 2, s, s),
              "do": _rnd(1, 2, s, s)}

    def body(g, t):
        p = g.softmax(g.matmul(t["q"], t["kt"]))
        delta = g.reduction(g.mul(t["o"], t["do"]), "sum", [3])
        d_scores = g.mul(p, g.sub(g.matmul(t["do"], _swap(g, t["v"])), delta))
        dv = g.matmul(_swap(g, p), t["do"])
        return {"dk": g.matmul(_swap(g, t["q"]), g.mul(d_scores, dv)), "dv": dv}
    _hand_check(inputs, body)


def test_dropout_with_values_broadcasting_past_the_probabilities_forward():
    """DEFECT (forward attention chain, codegen/sdpa.py drop_row; predates this commit): with v
    broader than p the forward kernel runs o's batches and draws dropout counters per o batch,
    while the dropout op's counters index p (batch 1): the output itself differs from
    g.reference (observed rel err ~0.5), and dv with it."""
    inputs = {"q": _rnd(1, 2, 9, 5), "kt": _rnd(1, 2, 5, 11), "v": _rnd(3, 2, 11, 7)}
    _as_function_check(inputs, _chain(dropout=0.3), ("v",))


@pytest.mark.parametrize("delta_from", ["scores", "d_probs"])
def test_delta_made_inside_the_group_is_not_fused(delta_from):
    """DEFECT (matcher, softmax_gradient/closed()): with Skv = 1 the scores matmul or dP itself
    has the [.., Sq, 1] shape of a row sum and can be the subtrahend; the matcher takes a value
    the group never stores as its delta operand. Observed: a bare KeyError from the launch's
    argument binding at execute (not a typed dnngraph error); expected: the graph's numbers
    (ds' = p (dP - s), or exactly 0 for dP - dP)."""
    inputs = {"q": _rnd(1, 2, 9, 5), "kt": _rnd(1, 2, 5, 1), "v": _rnd(1, 2, 1, 7), "do": _rnd(1, 2, 9, 7)}

    def body(g, t):
        scores = g.matmul(t["q"], t["kt"])
        p = g.softmax(scores)
        d_probs = g.matmul(t["do"], _swap(g, t["v"]))
        delta = scores if delta_from == "scores" else d_probs
        return {"dq": g.matmul(g.mul(p, g.sub(d_probs, delta)), _swap(g, t["kt"]))}
    _hand_check(inputs, body)


def test_delta_is_the_dv_product_is_not_fused():
    """DEFECT (matcher): Dv = 1 and Sq = Skv make the group's own dV product [.., Skv, 1] fit
    the delta operand; the dK/dV kernel loads it while still writing it. Observed: dk NaN
    (poison); dq, taken in the later kernel, happens to be right."""
    s = 8
    inputs = {"q": _rnd(1, 2, s, 5), "kt": _rnd(1, 2, 5, s), "v": _rnd(1, 2, s, 1), "do": _rnd(1, 2, s, 1)}

    def body(g, t):
        p = g.softmax(g.matmul(t["q"], t["kt"]))
        dv = g.matmul(_swap(g, p), t["do"])
        d_scores = g.mul(p, g.sub(g.matmul(t["do"], _swap(g, t["v"])), dv))
        return {"dk": g.matmul(_swap(g, t["q"]), d_scores), "dq": g.matmul(d_scores, _swap(g, t["kt"])), "dv": dv}
    _hand_check(inputs, body)


# --- regression tests: cases that held up --------------------------------------------------------

FUSED = ["reduction", "attention_backward", "attention_backward", "attention_backward"]
B, H, SQ, SKV, D, DV = 2, 2, 9, 11, 5, 7


def _qkv(lead=(B, H), s_q=SQ, s_kv=SKV, d=D, dv=DV):
    return {"q": _rnd(*lead, s_q, d), "kt": _rnd(*lead, d, s_kv), "v": _rnd(*lead, s_kv, dv)}


@pytest.mark.parametrize("side_shape", [(SQ, SKV), (B, 1, 1, SKV), (1, H, SQ, 1), (1,), (SKV,), (H, 1, SKV),
                                        (B, H, SQ, SKV)])
@pytest.mark.parametrize("op", ["add", "sub_reversed", "div_reversed"])
def test_side_broadcasts_and_reversed_operands(side_shape, op):
    """Sides of every broadcast shape; the scores as the second operand of sub and div."""
    def score(g, t, s):
        if op == "add":
            return g.add(s, t["side"])
        if op == "sub_reversed":
            return g.sub(t["side"], s)
        return g.div(t["side"], g.add(g.mul(s, s), 1.0))
    assert _as_function_check({**_qkv(), "side": _rnd(*side_shape)}, _chain(score), ALL) == FUSED


@pytest.mark.parametrize("case", ["int_add", "int64_mul", "bool_where", "bool_where_reversed", "int_condition",
                                  "int_other", "bool_mul", "side_twice", "scores_squared", "scores_doubled",
                                  "div_by_zero_side", "inf_side", "nan_side", "rows_of_minus_inf"])
def test_score_ops_held_up(case):
    """Integer and bool sides, constants in where, a side read twice, the scores read twice by
    one op, score ops making inf, NaN and rows of -inf: fused, and NaN where torch has NaN."""
    mask = torch.rand(SQ, SKV, generator=GEN) > 0.4
    cases = {
        "int_add": (torch.randint(-3, 3, (SQ, SKV), generator=GEN, dtype=torch.int32), lambda g, t, s: g.add(s, t["side"])),
        "int64_mul": (torch.randint(1, 3, (1, 1, 1, SKV), generator=GEN), lambda g, t, s: g.mul(s, t["side"])),
        "bool_where": (mask, lambda g, t, s: g.where(t["side"], s, -1e4)),
        "bool_where_reversed": (mask, lambda g, t, s: g.where(t["side"], -2.0, s)),
        "int_condition": (mask.int(), lambda g, t, s: g.where(t["side"], s, float("-inf"))),
        "int_other": (torch.randint(-3, 3, (1, SKV), generator=GEN, dtype=torch.int32),
                      lambda g, t, s: g.where(g.cmp_gt(t["side"], 0), s, t["side"])),
        "bool_mul": (mask, lambda g, t, s: g.mul(s, t["side"])),
        "side_twice": (_rnd(1, 1, SQ, SKV), lambda g, t, s: g.add(g.mul(s, t["side"]), t["side"])),
        "scores_squared": (None, lambda g, t, s: g.mul(s, s)),
        "scores_doubled": (None, lambda g, t, s: g.add(s, s)),
        "div_by_zero_side": (torch.tensor([[1.0] * (SKV - 1) + [0.0]]), lambda g, t, s: g.div(s, t["side"])),
        "inf_side": (torch.tensor([1.0] * (SKV - 1) + [float("inf")]), lambda g, t, s: g.mul(s, t["side"])),
        "nan_side": (torch.tensor([0.0] * (SKV - 1) + [float("nan")]), lambda g, t, s: g.add(s, t["side"])),
        "rows_of_minus_inf": (torch.tensor([0.0] * (SQ - 2) + [float("-inf")] * 2).view(SQ, 1),
                              lambda g, t, s: g.add(s, t["side"])),
    }
    side, score = cases[case]
    inputs = _qkv() if side is None else {**_qkv(), "side": side}
    kinds = _as_function_check(inputs, _chain(score), ALL)
    if case != "int_other":
        assert kinds == FUSED


@pytest.mark.parametrize("case", ["maximum_const", "minimum_side", "where_scores_positive", "scores_read_twice"])
def test_score_ops_that_stay_unfused_are_right(case):
    """maximum/minimum (their gradients read the scores outside the group), where(s > 0, s, 0)
    and a DAG of score ops: the backward stays op by op, and is right."""
    scores = {"maximum_const": lambda g, t, s: g.maximum(s, 0.5),
              "minimum_side": lambda g, t, s: g.minimum(t["side"], s),
              "where_scores_positive": lambda g, t, s: g.where(g.cmp_gt(s, 0.0), s, 0.0),
              "scores_read_twice": lambda g, t, s: g.add(g.sub(s, g.mul(s, 0.5)), g.mul(s, s))}
    _as_function_check({**_qkv(), "side": _rnd(SQ, 1)}, _chain(scores[case]), ALL)


@pytest.mark.parametrize("lead, s_q, s_kv, d, dv", [((3,), 9, 11, 5, 7), ((2, 2), 1, 11, 5, 7), ((2, 2), 9, 1, 5, 7),
                                                   ((2, 2), 9, 11, 1, 1), ((1, 1), 1, 1, 3, 3),
                                                   ((1, 2), 33, 17, 20, 3)])
def test_sizes(lead, s_q, s_kv, d, dv):
    """Rank 3, Sq = 1, Skv = 1, head dim 1, non-power-of-two dims."""
    side = _rnd(s_q, s_kv)
    assert _as_function_check({**_qkv(lead, s_q, s_kv, d, dv), "side": side},
                              _chain(lambda g, t, s: g.add(s, t["side"])), ALL) == FUSED


@pytest.mark.parametrize("q_lead, k_lead", [((2, 3), (2, 1)), ((1, 3), (2, 3))])
def test_broadcast_q_or_k(q_lead, k_lead):
    """MQA written as ops (k, v [B, 1, ..]) and q shared over the batch."""
    inputs = {"q": _rnd(*q_lead, SQ, D), "kt": _rnd(*k_lead, D, SKV), "v": _rnd(*k_lead, SKV, DV)}
    if q_lead[0] == 1:
        inputs["v"] = _rnd(2, 3, SKV, DV)  # v as broad as the scores
    kinds = _as_function_check(inputs, _chain(dropout=0.3), ALL)
    assert kinds.count("attention_backward") == 3


def test_strided_inputs_and_kernel_variable_names():
    """BSHD-transposed q, k^T and v, and tensor names that look like kernel variables."""
    inputs = {"q_tile": _rnd(2, 9, 3, 5).transpose(1, 2), "scores": _rnd(2, 3, 11, 5).transpose(2, 3),
              "lse_row": _rnd(2, 11, 3, 7).transpose(1, 2), "logits": _rnd(9, 11),
              "visible": torch.rand(9, 11, generator=GEN) > 0.2, "d_grad": _rnd(1, 3, 1, 11)}

    def body(g, t):
        s = g.matmul(t["q_tile"], t["scores"])
        s = g.where(t["visible"], g.add(g.mul(s, 0.3), g.mul(t["logits"], t["d_grad"])), float("-inf"))
        return g.matmul(g.softmax(s).set_name("p_tile"), t["lse_row"])
    assert _as_function_check(inputs, body, ("q_tile", "scores", "lse_row")).count("attention_backward") == 3


def test_dropout_with_tensor_seeds():
    inputs = {**_qkv(), "seed": torch.tensor([1234]), "off": torch.tensor([77])}

    def body(g, t):
        s = g.mul(g.matmul(t["q"], t["kt"]), 0.4)
        return g.matmul(g.dropout(g.softmax(s), 0.25, t["seed"], t["off"]), t["v"])
    assert _as_function_check(inputs, body, ALL) == FUSED


def test_two_chains_sharing_q_and_an_output_read_twice():
    def body(g, t):
        first = _chain()(g, t)
        second = g.matmul(g.softmax(g.mul(g.matmul(t["q"], t["kt2"]), 0.2)), t["v"])
        both = g.add(first, second)
        return g.add(g.mul(both, both), g.tanh(both))
    kinds = _as_function_check({**_qkv(), "kt2": _rnd(B, H, D, SKV)}, body, ALL + ("kt2",))
    assert kinds.count("attention_backward") == 6


def test_one_tensor_as_q_kt_and_v():
    def body(g, t):
        return g.matmul(g.softmax(g.mul(g.matmul(t["a"], t["a"]), 0.3)), t["a"])
    assert _as_function_check({"a": _rnd(2, 2, 8, 8)}, body, ("a",)).count("attention_backward") == 3


@pytest.mark.parametrize("delta", ["axes_2_3", "rank2_side", "one_element", "integer"])
def test_hand_written_delta_forms(delta):
    """The kernel takes delta as the graph gives it (any broadcast form), not as rowsum(o dO)."""
    inputs = {**_qkv(), "o": _rnd(B, H, SQ, DV), "do": _rnd(B, H, SQ, DV)}
    sides = {"rank2_side": _rnd(SQ, 1), "one_element": _rnd(1),
             "integer": torch.randint(-2, 3, (B, H, SQ, 1), generator=GEN, dtype=torch.int32)}
    if delta in sides:
        inputs["dl"] = sides[delta]

    def body(g, t):
        p = g.softmax(g.mul(g.matmul(t["q"], t["kt"]), 0.5))
        row = g.reduction(g.mul(t["o"], t["do"]), "sum", [2, 3]) if delta == "axes_2_3" else t["dl"]
        d_scores = g.mul(g.mul(p, g.sub(g.matmul(t["do"], _swap(g, t["v"])), row)), 0.5)
        return {"dq": g.matmul(d_scores, _swap(g, t["kt"])), "dk": g.matmul(_swap(g, t["q"]), d_scores),
                "dv": g.matmul(_swap(g, p), t["do"])}
    assert "attention_backward" in _hand_check(inputs, body)


@pytest.mark.parametrize("variant", ["mul_swapped", "sub_reversed", "dq_other_k", "dk_other_q", "other_axes",
                                     "p_read_by_gradient"])
def test_hand_written_lookalikes_stay_unfused(variant):
    """Graphs that look like the pattern but compute something else are not fused (and right)."""
    inputs = {**_qkv(), "o": _rnd(B, H, SQ, DV), "do": _rnd(B, H, SQ, DV), "kt2": _rnd(B, H, D, SKV),
              "q2": _rnd(B, H, SQ, D)}

    def body(g, t):
        p = g.softmax(g.mul(g.matmul(t["q"], t["kt"]), 0.5))
        delta = g.reduction(g.mul(t["o"], t["do"]), "sum", [3])
        d_probs = g.matmul(t["do"], _swap(g, t["v"]))
        diff = g.sub(delta, d_probs) if variant == "sub_reversed" else g.sub(d_probs, delta)
        d_scores = g.mul(diff, p) if variant == "mul_swapped" else g.mul(p, diff)
        if variant == "p_read_by_gradient":
            d_scores = g.add(d_scores, p)
        kt_for_dq = t["kt2"] if variant == "dq_other_k" else t["kt"]
        dq_t = g.transpose(kt_for_dq, [1, 0, 3, 2]) if variant == "other_axes" else _swap(g, kt_for_dq)
        q_for_dk = t["q2"] if variant == "dk_other_q" else t["q"]
        return {"dq": g.matmul(d_scores, dq_t), "dk": g.matmul(_swap(g, q_for_dk), d_scores),
                "dv": g.matmul(_swap(g, p), t["do"])}
    if variant == "other_axes":
        inputs["kt"] = _rnd(B, B, D, SKV)  # square leading axes so the permuted transpose is valid
        inputs["q"] = _rnd(B, B, SQ, D)
    assert "attention_backward" not in _hand_check(inputs, body)


def test_fp16_chain_with_a_float32_bias():
    inputs = {"q": _rnd(2, 2, 9, 8).half(), "kt": _rnd(2, 2, 8, 11).half(), "v": _rnd(2, 2, 11, 8).half(),
              "bias": _rnd(1, 1, 9, 11)}
    kinds = _as_function_check(inputs, _chain(lambda g, t, s: g.add(s, t["bias"])), ALL, tolerance=3e-3,
                               io=dg.float16)
    assert kinds.count("attention_backward") == 3
