"""The Gluon backend's attention forward (backends/gluon/attention_*.py): sdpa on sm_90a.

CPU (here): every type x head dim x mask x head grouping variant renders and compiles for sm_90a
(tests/sm90_compile.py) with warp specialization, setmaxnreg, wgmma and no spills; supports()
names why it refuses what it does not take; the kernel's key-block bounds against the mask rule;
default builds rank gluon against Triton by the measured models (gluon first exactly where it
measured faster), opting in prefers it elsewhere. GPU (@pytest.mark.gpu, an H100 or H200):
results against the float64 reference (o and the stats, every mask and band), a Triton backward
on the Gluon stats, a default build's choice, and small runs under Triton's concurrency sanitizer.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from gluon_attention_cases import (BANDS, HEAD_DIMS, HEADS, MASKS, TYPES, compile_cases, graph, lowered,
                                   mask_arguments, sdpa_group, variants)
from helpers import CONSAN_HEAD, check, clean_under_consan, compiled_for_sm90

import dnngraph as dg
from dnngraph.backends import registry
from dnngraph import build
from dnngraph.backends.contract import BuildContext
from dnngraph.backends.gluon import attention_backend
from dnngraph.backends.triton.heuristics import sdpa as sdpa_heuristics
from dnngraph.backends.gluon.backend import GLUON
from dnngraph.options import BuildOptions
from dnngraph.target import H100, H200

GLUON_FIRST = ("gluon", "triton")


# -- every variant compiles for sm_90a -------------------------------------------------------------

def test_every_attention_variant_compiles_for_sm90a_with_warp_specialization():
    expected = sum(1 for _ in compile_cases())
    output = compiled_for_sm90("gluon_attention_cases:compile_cases", timeout=1800)
    assert f"compiled {expected} kernels for sm_90" in output
    facts = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2])
             for line in output.splitlines() if line.startswith("facts ")}
    assert len(facts) == expected
    for label, found in facts.items():
        assert found["warp_specialize"], label  # the producer and the two consumer partitions
        assert found["setmaxnreg"] > 0, label
        assert found["wgmma"] > 0 and found["tma_load"] > 0, label
        assert found["shared"] <= H100.shared_memory, label
        assert found["global_scratch"] > 0, label  # device-side descriptors
        assert found["spill_stores"] == 0, label
    for prefix in ("bf16/d64/none/mha", "fp16/d128/causal/gqa/stats", "fp16/d128/causal_bottom_right/mqa"):
        assert any(label.startswith(prefix) for label in facts), prefix


def test_the_compile_variants_meet_every_pair_of_type_and_shape():
    """variants() compiles each head dim x mask x grouping in one 16-bit type: each type must
    still meet every head dim, mask and grouping, or a failure of one type could hide behind
    the other's cases."""
    cases = list(variants())
    assert {case[1:4] for case in cases} == {(d, m, h) for d in HEAD_DIMS for m in MASKS for h in ("mha", "gqa", "mqa")}
    for position, values in ((1, HEAD_DIMS), (2, MASKS), (3, ("mha", "gqa", "mqa"))):
        assert {(case[0], case[position]) for case in cases} == {(t, v) for t in TYPES for v in values}, position


# -- what it takes and what it refuses -------------------------------------------------------------

def _problem(**kwargs):
    return sdpa_group(graph(**kwargs))[1]


def test_candidates_fit_shared_memory_and_carry_estimates():
    for head_dim in (64, 128):
        problem = _problem(type_name="bf16", head_dim=head_dim, mask="causal", heads="gqa", stats=True)
        assert GLUON.supports(problem, H100) is True
        offered = GLUON.candidates(problem, H100)
        assert [c.config for c in offered] == list(attention_backend.CONFIGS[head_dim])
        assert [c.config.pingpong for c in offered] == [False, True]
        for candidate in offered:
            # S 200 was never measured: no estimate
            assert candidate.backend == "gluon" and candidate.estimate is None
            assert attention_backend.shared_bytes(candidate.config, head_dim, 2) <= H100.shared_memory
            assert GLUON.estimate(problem, candidate.config, H100) is None
        measured_mask = "causal" if head_dim == 128 else "none"  # D64 was measured unmasked only
        problem = _problem(type_name="bf16", head_dim=head_dim, mask=measured_mask, heads="gqa", stats=True, batch=1,
                           s_q=4096, s_kv=4096)
        for candidate in GLUON.candidates(problem, H100):
            assert candidate.estimate > sdpa_heuristics.LAUNCH_SECONDS
            assert GLUON.estimate(problem, candidate.config, H100) == candidate.estimate


def test_lower_gives_one_launch_per_query_block_and_head_with_an_unaligned_fallback():
    g = graph("fp16", 128, "causal_bottom_right", "gqa", stats=True, batch=3, s_q=300, s_kv=500, attn_scale=0.3)
    (launch,) = lowered(g)
    assert tuple(launch.grid)[:2] == (3, 12)  # cdiv(300, 128) query blocks, B * H
    values = {a.name: a.value for a in launch.arguments}
    assert values["CAUSAL"] and values["STATS"] and values["HEAD_DIM"] == 128
    assert values["shift"] == 200 and values["group"] == 2 and values["heads"] == 4
    assert values["QK_SCALE"] == pytest.approx(0.3 * attention_backend.LOG2E)
    assert launch.alternative is not None and launch.alternative.config_text != launch.config_text
    # top-left causal: no shift; the default scale 1/sqrt(D)
    (launch,) = lowered(graph("bf16", 64, "causal", "mha", s_q=300, s_kv=500))
    values = {a.name: a.value for a in launch.arguments}
    assert values["shift"] == 0 and not values["STATS"] and "stats_ptr" not in values
    assert values["QK_SCALE"] == pytest.approx(attention_backend.LOG2E / 8)
    assert values["PINGPONG"] is False


def test_a_given_config_is_lowered_and_one_not_offered_is_refused():
    g = graph("bf16", 128, "causal", "gqa", stats=True)
    pingpong = attention_backend.CONFIGS[128][1]
    (launch,) = lowered(g, config=pingpong)
    assert {a.name: a.value for a in launch.arguments}["PINGPONG"] is True
    assert launch.config_text.startswith(pingpong.text)
    with pytest.raises(dg.UnsupportedError, match="not one this problem can run"):
        lowered(g, config=attention_backend.AttentionConfig(128, 128, 9))


def _refused(g, target=H100):
    answer = GLUON.supports(sdpa_group(g)[1], target)
    assert isinstance(answer, str) and answer.startswith("gluon"), answer
    return answer


def _tensors(g, t=dg.bfloat16, b=2, h=4, h_kv=4, s=200, d=64, dv=None):
    q = g.tensor(name="q", dim=[b, h, s, d], data_type=t)
    k = g.tensor(name="k", dim=[b, h_kv, s, d], data_type=t)
    v = g.tensor(name="v", dim=[b, h_kv, s, dv or d], data_type=t)
    return q, k, v


def _sdpa_graph(t=dg.bfloat16, d=64, dv=None, **attrs):
    g = dg.Graph(name="refused", io_data_type=t if t in (dg.bfloat16, dg.float16) else dg.float32)
    q, k, v = _tensors(g, t, d=d, dv=dv)
    o, _ = g.sdpa(q, k, v, **attrs)
    o.set_output(True)
    return g


def test_supports_names_why_it_refuses():
    assert "sm_90a" in _refused(_sdpa_graph(), dataclasses.replace(H100, capability=(10, 0)))
    assert "head dims 64 or 128" in _refused(_sdpa_graph(d=96))
    assert "same head dim" in _refused(_sdpa_graph(d=64, dv=128))
    assert "float16 or bfloat16" in _refused(_sdpa_graph(t=dg.float32))
    assert "dropout" in _refused(_sdpa_graph(dropout=(0.1, 1, 0)))
    # a bias, padding lengths
    g = dg.Graph(name="bias", io_data_type=dg.bfloat16)
    q, k, v = _tensors(g)
    o, _ = g.sdpa(q, k, v, bias=g.tensor(name="bias", dim=[1, 1, 200, 200], data_type=dg.bfloat16))
    o.set_output(True)
    assert "bias" in _refused(g)
    g = dg.Graph(name="lengths", io_data_type=dg.bfloat16)
    q, k, v = _tensors(g)
    o, _ = g.sdpa(q, k, v, seq_len_kv=g.tensor(name="lens", dim=[2, 1, 1, 1], data_type=dg.int32))
    o.set_output(True)
    assert "padding lengths" in _refused(g)
    # a fused epilogue on o
    g = dg.Graph(name="epilogue", io_data_type=dg.bfloat16)
    q, k, v = _tensors(g)
    o, _ = g.sdpa(q, k, v)
    g.relu(o).set_output(True)
    assert "fuses no pointwise ops" in _refused(g)
    # q's last axis not contiguous
    g = dg.Graph(name="strided", io_data_type=dg.bfloat16)
    q = g.tensor(name="q", dim=[2, 4, 200, 64], stride=[4 * 200 * 64, 200 * 64, 1, 200], data_type=dg.bfloat16)
    k, v = (g.tensor(name=n, dim=[2, 4, 200, 64], data_type=dg.bfloat16) for n in ("k", "v"))
    o, _ = g.sdpa(q, k, v)
    o.set_output(True)
    assert "through TMA" in _refused(g)


@pytest.mark.parametrize("mask", sorted(BANDS))
def test_band_masks_are_taken_and_lowered_with_their_shifts(mask):
    """Key j visible to query i when j <= i + shift (a right bound) and j >= i + window_shift
    (a left bound), the alignment's offset Skv - Sq bottom right (ops/sdpa.py's rule)."""
    left, right, bottom_right = BANDS[mask]
    g = graph("bf16", 128, mask, "gqa", stats=True, s_q=300, s_kv=700)
    assert GLUON.supports(sdpa_group(g)[1], H100) is True
    (launch,) = lowered(g)
    values = {a.name: a.value for a in launch.arguments}
    aligned = 400 if bottom_right else 0
    assert values["CAUSAL"] == (right is not None) and values["WINDOW"]
    assert values["shift"] == aligned + (right or 0) and values["window_shift"] == aligned - left + 1
    # a bound past Sq + Skv masks nothing: no mask arithmetic for it
    g = _sdpa_graph(diagonal_band_left_bound=400, diagonal_band_right_bound=0)
    (launch,) = GLUON.lower(g, *sdpa_group(g), BuildContext(torch.device("cuda"), H100, BuildOptions(target=H100)))
    values = {a.name: a.value for a in launch.arguments}
    assert values["CAUSAL"] and not values["WINDOW"] and values["shift"] == 0


def _visible(rows, cols, shift, window_shift, causal, window, s_kv):
    """ops/sdpa.py's rule on the kernel's shifts, as a [rows, cols] bool grid."""
    seen = (cols[None, :] < s_kv).expand(len(rows), -1)
    if causal:
        seen = seen & (cols[None, :] <= rows[:, None] + shift)
    if window:
        seen = seen & (cols[None, :] >= rows[:, None] + window_shift)
    return seen


@pytest.mark.parametrize("s_q,s_kv", [(77, 1031), (1031, 77), (300, 300), (1, 5), (513, 700)])
@pytest.mark.parametrize("bounds", [(None, 0), (64, 0), (100, 20), (150, None), (1, 0), (None, None), (5000, None)])
@pytest.mark.parametrize("bottom_right", [False, True])
def test_key_blocks_visit_every_seen_key_and_skip_mask_arithmetic_only_where_every_row_sees_all(s_q, s_kv, bounds,
                                                                                              bottom_right):
    """The kernel's own key_blocks and needs_mask (their Python bodies, run on ints): per
    program, no key a real row sees lies outside the visited blocks [lo, hi), no visited block
    is one no row sees, and a block that takes no mask arithmetic is seen whole by every row."""
    from dnngraph.backends.gluon import attention_library as alib

    left, right = bounds
    aligned = s_kv - s_q if bottom_right else 0
    shift = aligned + (right or 0)
    window_shift = aligned - left + 1 if left is not None else 0
    causal, window = right is not None, left is not None
    block_m = block_n = 128
    cols = torch.arange(-(-s_kv // block_n) * block_n + block_n)
    for first_row in range(0, s_q, block_m):
        lo, full_lo, full_hi, hi = alib.key_blocks.fn(first_row, s_kv, shift, window_shift, block_m, block_n, causal,
                                                      window)
        rows = torch.arange(first_row, min(first_row + block_m, s_q))
        seen = _visible(rows, cols, shift, window_shift, causal, window, s_kv)
        seen_blocks = seen.view(len(rows), -1, block_n).any(dim=2).any(dim=0)
        whole_blocks = seen.view(len(rows), -1, block_n).all(dim=2).all(dim=0)
        visited = torch.zeros_like(seen_blocks)
        visited[lo:max(hi, lo)] = True
        assert lo <= hi and not (seen_blocks & ~visited).any(), (first_row, lo, hi)
        if window or causal:  # the padding rows past Sq may see a block no real row does
            assert visited.sum() <= seen_blocks.sum() + 1, (first_row, lo, hi)
        for block in range(lo, hi):
            if not alib.needs_mask.fn(block, full_lo, full_hi):
                assert whole_blocks[block], (first_row, block, full_lo, full_hi)


def test_supports_refuses_the_softmax_extras():
    """A sink token, ALiBi, score outputs and a tensor scale: the Triton kernel's alone."""
    assert "ALiBi" in _refused(_sdpa_graph(use_alibi_mask=True))
    g = dg.Graph(name="sink", io_data_type=dg.bfloat16)
    q, k, v = _tensors(g)
    o, _ = g.sdpa(q, k, v, sink_token=g.tensor(name="sink", dim=[1, 4, 1, 1], data_type=dg.float32))
    o.set_output(True)
    assert "sink token" in _refused(g)
    g = dg.Graph(name="scale", io_data_type=dg.bfloat16)
    q, k, v = _tensors(g)
    o, _ = g.sdpa(q, k, v, attn_scale=g.tensor(name="scale", dim=[1, 1, 1, 1], data_type=dg.float32))
    o.set_output(True)
    assert "tensor attn_scale" in _refused(g)
    g = dg.Graph(name="scores", io_data_type=dg.bfloat16)
    q, k, v = _tensors(g)
    for t in g.sdpa(q, k, v, score_max=True)[::2]:
        t.set_output(True)
    assert "score_max" in _refused(g)


def test_supports_refuses_a_block_mask_and_own_v_heads():
    """A block-sparse mask and k and v of different head counts: the Triton kernels' alone."""
    g = dg.Graph(name="blocks", io_data_type=dg.bfloat16)
    q, k, v = _tensors(g)
    o, _ = g.sdpa(q, k, v, block_mask=g.tensor(name="blocks", dim=[1, 1, 2, 2], data_type=dg.bool))
    o.set_output(True)
    assert "block-sparse mask" in _refused(g)
    g = dg.Graph(name="heads", io_data_type=dg.bfloat16)
    q, k, _ = _tensors(g)
    v = g.tensor(name="v1", dim=[2, 1, 200, 64], data_type=dg.bfloat16)
    o, _ = g.sdpa(q, k, v)
    o.set_output(True)
    assert "one head count" in _refused(g)


def test_a_grid_past_the_targets_limits_is_refused_at_lowering():
    """batch x heads = 65536 programs on grid axis y (limit 65535): gluon refuses at lowering, so
    a build that opted in passes the group to the Triton kernel, which folds its grid."""
    g = graph("bf16", 64, "none", "mha", batch=16384, s_q=8, s_kv=8)
    with pytest.raises(dg.UnsupportedError, match="grid"):
        lowered(g)
    fits = graph("bf16", 64, "none", "mha", batch=8, s_q=8, s_kv=8)
    (launch,) = lowered(fits)
    assert H100.grid_fits(launch.grid)


@pytest.mark.parametrize("attn_scale", [0.0, -0.5])
def test_a_scale_that_is_not_positive_is_refused_at_lowering(attn_scale):
    """The kernel applies the scale to the row max of the raw scores, which is the max of the
    scaled scores only for a positive scale: others go to the Triton kernel."""
    with pytest.raises(dg.UnsupportedError, match="positive attention scale"):
        lowered(graph("bf16", 64, "causal", "mha", attn_scale=attn_scale))


def test_supports_refuses_the_backward_and_paged_k_v():
    g = dg.Graph(name="backward", io_data_type=dg.bfloat16)
    q, k, v = _tensors(g)
    o = g.tensor(name="o", dim=[2, 4, 200, 64], data_type=dg.bfloat16)
    d_o = g.tensor(name="do", dim=[2, 4, 200, 64], data_type=dg.bfloat16)
    stats = g.tensor(name="stats", dim=[2, 4, 200, 1], data_type=dg.float32)
    for out in g.sdpa_backward(q, k, v, o, d_o, stats):
        if out is not None:
            out.set_output(True)
    assert "backward" in _refused(g)
    g = dg.Graph(name="paged", io_data_type=dg.bfloat16)
    q = g.tensor(name="q", dim=[2, 4, 16, 64], data_type=dg.bfloat16)
    k = g.tensor(name="k", dim=[8, 4, 32, 64], data_type=dg.bfloat16)
    v = g.tensor(name="v", dim=[8, 4, 32, 64], data_type=dg.bfloat16)
    tables = [g.tensor(name=n, dim=[2, 1, 4, 1], data_type=dg.int32) for n in ("kt", "vt")]
    o, _ = g.sdpa(q, k, v, seq_len_kv=g.tensor(name="lens", dim=[2, 1, 1, 1], data_type=dg.int32),
                  paged_attention_k_table=tables[0], paged_attention_v_table=tables[1])
    o.set_output(True)
    assert _refused(g)


def test_default_options_take_gluon_for_sdpa_only():
    assert "sdpa" in GLUON.families and registry.BACKENDS["gluon"] is GLUON and "sdpa" in registry.families()
    assert BuildOptions().backends == ("triton", "gluon:conv,sdpa")
    problem = _problem(type_name="bf16", head_dim=128, mask="none", heads="mha", batch=1, s_q=4096, s_kv=4096)
    for target in (H100, H200):
        supporting = registry.supporting(problem, target, BuildOptions(target=target))
        assert [b.name for b in supporting] == ["triton", "gluon"]
        # never on interpreted builds, nor on another target
        assert registry.choose(problem, target, BuildOptions(target=target), interpreted=True).name == "triton"
        other = dataclasses.replace(target, capability=(10, 0))
        assert [b.name for b in registry.supporting(problem, other, BuildOptions(target=other))] == ["triton"]


# -- the ranking of the two attention forwards (plain data: a named GPU's Target, no GPU) ----------

# BENCHMARKS.md "Gluon attention forward" rows: (type, head dim, mask, heads, batch, S), the backend
# measured faster (plain schedule against the Triton kernel, one H200 process)
MEASURED_ROWS = [
    (("bf16", 128, "none", "mha", 4, 4096), "gluon"),  # 566 vs 473 TFLOP/s, 1.20x
    (("bf16", 128, "causal", "mha", 4, 4096), "gluon"),  # 506 vs 429, 1.18x
    (("bf16", 128, "causal", "single", 1, 16384), "gluon"),  # B1 H16 S16384 causal: 605 vs 472, 1.28x
    (("bf16", 128, "causal", "gqa", 4, 4096), "gluon"),  # GQA 32:8 causal: 502 vs 432, 1.16x
    (("bf16", 64, "none", "mha", 8, 2048), "triton"),  # B8 H16 S2048 D64: 370 vs 413, 0.89x
]


@pytest.mark.parametrize("target", [H100, H200], ids=["h100", "h200"])
@pytest.mark.parametrize("row,faster", MEASURED_ROWS, ids=[f"d{r[1]}-{r[2]}-{r[3]}-s{r[5]}" for r, _ in MEASURED_ROWS])
@pytest.mark.parametrize("stats", [False, True])
def test_default_ranking_takes_the_backend_measured_faster(target, row, faster, stats):
    type_name, head_dim, mask, heads, batch, s = row
    problem = _problem(type_name=type_name, head_dim=head_dim, mask=mask, heads=heads, stats=stats, batch=batch,
                       s_q=s, s_kv=s)
    options = BuildOptions(target=target)
    pairs = registry.ranked(problem, target, options, interpreted=False)
    firsts = {}
    for backend, candidate in pairs:
        firsts.setdefault(backend.name, candidate.estimate)
    assert set(firsts) == {"gluon", "triton"} and None not in firsts.values()
    assert pairs[0][0].name == faster == registry.choose(problem, target, options, interpreted=False).name
    assert registry.ranking_reason(pairs).startswith(f"backend {faster} ranked over")
    assert "by the model" in registry.ranking_reason(pairs)
    # the estimates' ratio is the measured one, within the wave and launch terms
    measured = attention_backend.MEASURED_TFLOPS[(head_dim, mask)][0] / \
        sdpa_heuristics.MEASURED_FORWARD_TFLOPS[(head_dim, mask)]
    assert firsts["triton"] / firsts["gluon"] == pytest.approx(measured, rel=0.03)
    # fp16 runs the same dots: the same choice
    assert registry.choose(_problem(type_name="fp16", head_dim=head_dim, mask=mask, heads=heads, batch=batch, s_q=s,
                                    s_kv=s), target, options, interpreted=False).name == faster


UNMEASURED = [dict(type_name="bf16", head_dim=128, mask="causal", heads="mha", batch=4, s_q=2048, s_kv=2048),
              dict(type_name="bf16", head_dim=128, mask="none", heads="mha", batch=4, s_q=4096, s_kv=1024),
              dict(type_name="bf16", head_dim=64, mask="causal", heads="mha", batch=8, s_q=4096, s_kv=4096),
              dict(type_name="fp16", head_dim=128, mask="causal_bottom_right", heads="gqa", batch=2, s_q=4096,
                   s_kv=8192),
              dict(type_name="bf16", head_dim=128, mask="none", heads="mqa", batch=2, s_q=200, s_kv=200)]


@pytest.mark.parametrize("kwargs", UNMEASURED, ids=["short-causal", "short-keys", "d64-causal", "bottom-right",
                                                    "small"])
def test_gluon_has_no_estimate_where_it_was_never_measured_so_triton_leads(kwargs):
    problem = _problem(**kwargs)
    for target in (H100, H200):
        assert all(c.estimate is None for c in GLUON.candidates(problem, target))
        pairs = registry.ranked(problem, target, BuildOptions(target=target), interpreted=False)
        assert pairs[0][0].name == "triton" and "preference order" in registry.ranking_reason(pairs)
        # a build that prefers gluon still takes it there
        assert registry.choose(problem, target, BuildOptions(backends=GLUON_FIRST, target=target),
                               interpreted=False).name == "gluon"


def test_a_default_build_lowers_d128_with_gluon_and_d64_with_triton():
    """The build's own choice (build.lower_ranked) for an H200 target without a GPU: the group's
    launches, the backend, and the reason explain() prints under "ranked:"."""
    cases = {128: (dict(batch=1, s_q=4096, s_kv=4096), "gluon"), 64: (dict(batch=2, s_q=2048, s_kv=2048), "triton")}
    for head_dim, (sizes, expected) in cases.items():
        g = graph("bf16", head_dim, "causal" if head_dim == 128 else "none", "gqa", stats=True, **sizes)
        group, problem = sdpa_group(g)
        context = BuildContext(torch.device("cuda"), H200, BuildOptions(target=H200))
        backend, launches, why = build.lower_ranked(g, group, problem, context, interpreted=False)
        assert backend.name == expected and why.startswith(f"backend {expected} ranked over") and "by the model" in why
        assert launches[0].config_text.startswith("gluon") == (expected == "gluon")


def test_backend_entries_are_validated():
    assert BuildOptions(backends=["triton", "gluon:sdpa"]).backends == ("triton", "gluon:sdpa")
    assert BuildOptions(backends=("gluon:matmul,sdpa",)).backends == ("gluon:matmul,sdpa",)
    for bad in (("gluon:pooling",), ("gluon:",), ("gluon", "gluon:sdpa"), ("nothing:sdpa",), (3,)):
        with pytest.raises(dg.ValidationError):
            BuildOptions(backends=bad)
    assert registry.families(("gluon:sdpa",)) == {"sdpa"}
    assert registry.signature(("gluon:sdpa",)) != registry.signature(("gluon",))


def test_opting_in_ranks_gluon_for_sdpa_on_sm90():
    problem = _problem(type_name="fp16", head_dim=64, mask="causal", heads="mqa", stats=True)
    options = BuildOptions(backends=GLUON_FIRST, target=H100)
    assert [b.name for b in registry.supporting(problem, H100, options)] == ["gluon", "triton"]
    pairs = registry.ranked(problem, H100, options, interpreted=False)
    assert "gluon" in {b.name for b, _ in pairs}
    assert registry.choose(problem, H100, BuildOptions(backends=("gluon",), target=H100)).name == "gluon"
    # never on interpreted builds, nor on another target
    assert registry.choose(problem, H100, options, interpreted=True).name == "triton"
    sm100 = dataclasses.replace(H100, capability=(10, 0))
    assert registry.choose(problem, sm100, options, interpreted=False).name == "triton"
    assert lowered(graph("fp16", 64, "causal", "mqa", stats=True))[0].config_text.startswith("gluon")


# -- on a GPU (H100 / H200) ------------------------------------------------------------------------

def _inputs(g, device="cuda") -> dict:
    return {t.name: torch.randn(*t.dim, device=device).to(t.data_type.torch_dtype)
            for t in g.tensors if t.producer is None}


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", sorted(TYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_gluon_attention_matches_the_reference(type_name, head_dim, mask, heads):
    g = graph(type_name, head_dim, mask, heads, stats=True, batch=2, s_q=200, s_kv=200)
    check(g, _inputs(g), dtype=TYPES[type_name].torch_dtype, device="cuda", options=BuildOptions(backends=("gluon",)))
    assert {launch.backend for launch in g.plan.launches} == {"gluon"}


@pytest.mark.gpu
@pytest.mark.parametrize("s_q,s_kv", [(1, 1), (1, 1000), (127, 127), (200, 127), (127, 1000), (1000, 200),
                                      (1000, 1000), (129, 257), (77, 1031)])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("schedule", ["plain", "pingpong"])
def test_odd_sequence_lengths(s_q, s_kv, mask, schedule, monkeypatch):
    """Lengths off the blocks, Sq != Skv both ways (bottom right with Sq > Skv: rows that see no
    key are zero, their stats -inf), with each schedule forced (CONFIGS holding only it; the scale
    differs per schedule so no plan of the other is taken from the plan cache)."""
    _force_schedule(monkeypatch, schedule)
    scale = 0.07 if schedule == "plain" else 0.071
    g = graph("bf16", 128, mask, "gqa", stats=True, batch=1, s_q=s_q, s_kv=s_kv, attn_scale=scale)
    check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", options=BuildOptions(backends=("gluon",)))
    assert ("schedule=pingpong" in g.plan.launches[0].config_text) == (schedule == "pingpong")


def _force_schedule(monkeypatch, schedule: str):
    """attention_backend.CONFIGS holding only the configs of `schedule` (plain or pingpong)."""
    forced = {d: tuple(c for c in configs if c.pingpong == (schedule == "pingpong"))
              for d, configs in attention_backend.CONFIGS.items()}
    monkeypatch.setattr(attention_backend, "CONFIGS", forced)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", MASKS)
def test_the_pingpong_schedule_matches_the_reference(head_dim, mask, monkeypatch):
    """Many key blocks (the turn barriers' phases wrap many times), several programs a head."""
    _force_schedule(monkeypatch, "pingpong")
    g = graph("fp16", head_dim, mask, "mqa", stats=True, batch=3, s_q=700, s_kv=1100, attn_scale=0.09)
    check(g, _inputs(g), dtype=torch.float16, device="cuda", options=BuildOptions(backends=("gluon",)))
    assert "schedule=pingpong" in g.plan.launches[0].config_text


@pytest.mark.gpu
@pytest.mark.parametrize("mask", sorted(BANDS))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("s_q,s_kv", [(77, 1031), (1031, 77), (700, 700), (1, 1000)])
@pytest.mark.parametrize("schedule", ["plain", "pingpong"])
def test_band_masks_match_the_reference(mask, head_dim, s_q, s_kv, schedule, monkeypatch):
    """Sliding windows and bands, both alignments, GQA, odd lengths both ways (rows that see no
    key: o zero, stats -inf), each schedule; o and the stats against float64."""
    _force_schedule(monkeypatch, schedule)
    scale = 0.08 if schedule == "plain" else 0.081
    type_name = "bf16" if head_dim == 128 else "fp16"
    g = graph(type_name, head_dim, mask, "gqa", stats=True, batch=2, s_q=s_q, s_kv=s_kv, attn_scale=scale)
    check(g, _inputs(g), dtype=TYPES[type_name].torch_dtype, device="cuda", options=BuildOptions(backends=("gluon",)))
    assert {launch.backend for launch in g.plan.launches} == {"gluon"}


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,mask", [(64, "causal"), (128, "none"), (128, "causal_bottom_right"), (128, "window"),
                                           (64, "band_bottom_right")])
def test_a_backward_built_on_gluon_stats_matches_the_reference(head_dim, mask):
    """A training forward (o and the stats by the Gluon kernel) and the Triton backward reading
    those stats, in one graph: stats in other units or layout than the Triton forward's would
    show in dq, dk and dv (and in the stats themselves)."""
    t = dg.bfloat16
    g = dg.Graph(name="gluon_training", io_data_type=t)
    b, h, h_kv, s_q, s_kv = 2, 4, 2, 77, 1031
    q = g.tensor(name="q", dim=[b, h, s_q, head_dim], data_type=t)
    k = g.tensor(name="k", dim=[b, h_kv, s_kv, head_dim], data_type=t)
    v = g.tensor(name="v", dim=[b, h_kv, s_kv, head_dim], data_type=t)
    d_o = g.tensor(name="do", dim=[b, h, s_q, head_dim], data_type=t)
    arguments = mask_arguments(mask)
    o, stats = g.sdpa(q, k, v, is_inference=False, name="attn", **arguments)
    o.set_output(True)
    stats.set_output(True)
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, name="attn_backward", **arguments)[:3]:
        grad.set_output(True)
    check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", options=BuildOptions(backends=("gluon", "triton")))
    forward, *backward = g.plan.launches  # the forward group first, then the backward's kernels
    assert forward.backend == "gluon" and forward.config_text.startswith("gluon")
    assert backward and {launch.backend for launch in backward} == {"triton"}


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the default takes gluon on sm_90 (H100, H200) only")
def test_a_default_build_runs_d128_on_gluon_and_d64_on_triton():
    """No options: the models rank Gluon's forward first at D128 (measured faster) and the
    Triton kernel at D64 (measured slower); explain() says which ran and why."""
    for head_dim, mask, s, expected in ((128, "causal", 4096, "gluon"), (128, "none", 4096, "gluon"),
                                        (64, "none", 2048, "triton"), (128, "causal", 1024, "triton")):
        g = graph("bf16", head_dim, mask, "gqa", stats=True, batch=1, s_q=s, s_kv=s)
        check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", reference_device="cuda")
        assert {launch.backend for launch in g.plan.launches} == {expected}, (head_dim, mask, s)
        assert f"ranked: backend {expected} ranked over" in g.explain()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_more_programs_than_sms(head_dim):
    """B * H * query blocks past the SMs (8 * 4 * 8 = 256 programs; 64 * 4 * 3 = 768), long key loops."""
    g = graph("fp16", head_dim, "causal", "mha", stats=False, batch=8, s_q=1000, s_kv=1000)
    check(g, _inputs(g), dtype=torch.float16, device="cuda", options=BuildOptions(backends=("gluon",)))
    g = graph("bf16", head_dim, "none", "mqa", stats=True, batch=64, s_q=300, s_kv=700)
    check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", options=BuildOptions(backends=("gluon",)))


@pytest.mark.gpu
def test_explain_names_gluon_for_sdpa():
    g = graph("bf16", 64, "causal", "gqa", stats=True, s_q=256, s_kv=256)
    check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", options=BuildOptions(backends=("gluon",)))
    text = g.explain()
    assert [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("  backend:")] == ["gluon"]


@pytest.mark.gpu
def test_an_unaligned_q_takes_the_triton_fallback():
    g = graph("bf16", 64, "none", "mha", s_q=130, s_kv=130)
    inputs = _inputs(g)
    storage = torch.empty(inputs["q"].numel() + 1, device="cuda", dtype=torch.bfloat16)
    inputs["q"] = storage[1:].view(inputs["q"].shape).copy_(inputs["q"])
    check(g, inputs, dtype=torch.bfloat16, device="cuda", options=BuildOptions(backends=("gluon",)))


CONSAN = CONSAN_HEAD + """from gluon_attention_cases import graph
from helpers import check
import dnngraph as dg
# three key blocks through the two-slot ring (its phases wrap), the causal diagonal, the stats
from dnngraph import build
from dnngraph.backends.contract import BuildContext
from dnngraph.backends.gluon import attention_backend
from dnngraph.backends.triton.heuristics import sdpa as sdpa_heuristics
from dnngraph.runtime import plan_cache
every_config = attention_backend.CONFIGS
for head_dim, mask, pingpong in ((128, "causal", False), (64, "none", False), (128, "causal", True),
                                 (64, "causal_bottom_right", True), (128, "window", False),
                                 (64, "band_bottom_right", True)):
    attention_backend.CONFIGS = {{d: tuple(c for c in configs if c.pingpong == pingpong)
                                 for d, configs in every_config.items()}}
    assert all(attention_backend.CONFIGS.values()), (pingpong, attention_backend.CONFIGS)
    plan_cache.clear()
    g = graph("bf16", head_dim, mask, "gqa", stats=True, batch=1, s_q=200, s_kv=330)
    inputs = {{t.name: torch.randn(*t.dim, device="cuda").to(t.data_type.torch_dtype)
              for t in g.tensors if t.producer is None}}
    check(g, inputs, dtype=torch.bfloat16, device="cuda", options=dg.BuildOptions(backends=("gluon",)))
print("consan clean")
"""


@pytest.mark.gpu
def test_a_small_attention_run_is_clean_under_the_concurrency_sanitizer(tmp_path):
    clean_under_consan(CONSAN, __file__, tmp_path)
