"""BuildOptions: validated when made (a typed error naming the field), equal and hashable by value,
taken by build(), as_function and the torch.compile backend; a forced config reaches its kernel
and explain() says so. (tests/runtime/test_plan_cache.py: every option is in the plan key.)"""
import dataclasses

import pytest
import torch

import dnngraph as dg
from dnngraph import torch_backend
from dnngraph.backends.triton.heuristics import depthwise as dw_heuristics
from dnngraph.backends.triton.heuristics import matmul as mm
from dnngraph.backends.triton.heuristics import moe as moe_heuristics
from dnngraph.backends.triton.heuristics import rows
from dnngraph.backends.triton.heuristics import sdpa as sdpa_heuristics
from helpers import check

TILE = sdpa_heuristics.AttentionConfig(16, 16, 1, 1)

BAD = [
    ("autotune", 1), ("autotune", "yes"), ("autotune_top", 0), ("autotune_top", 2.0),
    ("workspace_limit", -1), ("workspace_limit", 1.5), ("workspace_limit", True),
    ("backends", ()), ("backends", ("cutlass",)), ("backends", "triton"), ("backends", ("triton", "triton")),
    ("target", "h100"), ("matmul_config", (16, 16, 16)),
    ("matmul_config", mm.MatmulConfig("tiled", 24, 16, 16, 4, 2)),
    ("matmul_config", mm.MatmulConfig("tiled", 16, 16, 16, 3, 2)),
    ("matmul_config", mm.MatmulConfig("tiled", 16, 16, 16, 4, 1, group_m=0)),
    ("conv_config", mm.MatmulConfig("tiled", 16, 16, 16, 4, 1, group_m=-1)),
    ("conv_config", mm.MatmulConfig("bogus", 16, 16, 16, 4, 2)),
    ("depthwise_config", dw_heuristics.DepthwiseConfig("scatter", 4, 32, 2)), ("row_mode", "twice"),
    ("moe_config", moe_heuristics.MoeConfig(8, 16, 16, 4, 2)), ("moe_config", (16, 16, 16, 4, 2)),
    ("row_config", ("split", 8, 4, 1, 3)), ("row_config", rows.RowConfig("split", 8, 3, 1, 3, 0.0)),
    ("norm_backward_programs", 0), ("sdpa_config", sdpa_heuristics.AttentionConfig(8, 16, 1, 1)),
    ("sdpa_dkdv_config", sdpa_heuristics.AttentionConfig(16, 16, 3, 1)), ("sdpa_dq_config", "16,16,1,1"),
    ("sdpa_splits", 0), ("sdpa_head_group", -1), ("sdpa_index_64", 0), ("row_loop_tile", 24), ("row_loop_tile", 1),
    ("row_split_min_reduced", 0), ("row_combine_values", 100), ("norm_backward_max_reduced", None),
    ("column_prefetch_tiles", -1), ("column_stream_apply", "no"), ("conv_fold_channels_below", 2.5),
    ("plan", -1), ("plan", (0, -2)), ("plan", ()), ("plan", 1.0),
]
BAD.append(("block_scale_config", (256, 4)))
BAD += [("lrn_tile_elements", 24), ("lrn_tile_elements", 8)]
BAD += [("lrn_schedule", "loop"), ("lrn_schedule", 1), ("lrn_programs", 0), ("lrn_programs", 2.0)]


@pytest.mark.parametrize("field, value", BAD, ids=lambda v: v if isinstance(v, str) else None)
def test_a_bad_value_is_a_validation_error_naming_the_field(field, value):
    with pytest.raises(dg.ValidationError, match=f"BuildOptions.{field}:"):
        dg.BuildOptions(**{field: value})


def test_every_field_has_a_bad_value_tried():
    assert {field for field, _ in BAD} == {f.name for f in dataclasses.fields(dg.BuildOptions)}


def test_build_takes_options_and_its_shorthand():
    g = _mlp()
    with pytest.raises(dg.ValidationError, match="options must be a dnngraph.BuildOptions"):
        g.build(options={"autotune": False})
    with pytest.raises(dg.ValidationError, match="BuildOptions.autotune"):
        g.build(autotune="yes")
    assert g.plan is None  # a failed build changes nothing
    g.build(workspace_limit=0, options=dg.BuildOptions(workspace_limit=1 << 20))
    assert g.plan.options.workspace_limit == 0  # the shorthand replaces the option


def test_options_are_frozen_values():
    forced = mm.MatmulConfig("tiled", 16, 16, 16, 4, 2)
    first, second = dg.BuildOptions(matmul_config=forced), dg.BuildOptions(matmul_config=dataclasses.replace(forced))
    assert first == second and hash(first) == hash(second) and len({first: 1, second: 2}) == 1
    assert first != dg.BuildOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.autotune = True
    assert dg.BuildOptions(backends=["triton"]).backends == ("triton",)


@pytest.mark.parametrize("value, top", [("all", None), ("3", 3), (" 0 ", 1), ("junk", 6)])
def test_autotune_top_defaults_to_the_environment_when_made(monkeypatch, value, top):
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", value)
    made = dg.BuildOptions()
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "2")
    assert made.autotune_top == top and dg.BuildOptions().autotune_top == 2


def _mlp(name="mlp"):
    g = dg.Graph(name=name)
    x, w = g.tensor(name="x", dim=[5, 24]), g.tensor(name="w", dim=[24, 40])
    g.softmax(g.relu(g.matmul(x, w)), axis=1).set_output(True).set_name("y")
    return g


def _inputs():
    return {"x": torch.randn(5, 24), "w": torch.randn(24, 40)}


def _conv(groups=1, op="fprop"):
    g = dg.Graph(name="conv")
    x = g.tensor(name="x", dim=[2, 4, 9, 8])
    w = g.tensor(name="w", dim=[4 if groups == 4 else 6, 4 // groups, 3, 3])
    out = g.conv_fprop(x, w, padding=[1, 1], groups=groups)
    g.relu(out).set_output(True).set_name("y")
    return g, {"x": torch.randn(2, 4, 9, 8), "w": torch.randn(*w.dim)}


def _row_sums():
    g = dg.Graph(name="sums")
    g.reduction(g.tensor(name="x", dim=[5, 40]), "sum", [1]).set_output(True).set_name("y")
    return g, {"x": torch.randn(5, 40)}


def _layernorm_backward(rows_=300):
    """Row blocks of 64 rows: 5 of them for 300 rows."""
    g = dg.Graph(name="lnb")
    x, dy, s = (g.tensor(name=n, dim=d) for n, d in (("x", [rows_, 33]), ("dy", [rows_, 33]), ("s", [1, 33])))
    m, i = (g.tensor(name=n, dim=[rows_, 1]) for n in ("m", "i"))
    for out in g.layernorm_backward(dy, x, s, m, i):
        out.set_output(True)
    return g, {"x": torch.randn(rows_, 33), "dy": torch.randn(rows_, 33), "s": torch.randn(1, 33),
               "m": torch.randn(rows_, 1), "i": torch.rand(rows_, 1) + 0.5}


def _attention(backward=False, s_q=37):
    g = dg.Graph(name="attention")
    q, k, v = (g.tensor(name=n, dim=[2, 4, s_q if n == "q" else 29, 16]) for n in ("q", "k", "v"))
    inputs = {n: torch.randn(2, 4, s_q if n == "q" else 29, 16) for n in "qkv"}
    if not backward:
        o, stats = g.sdpa(q, k, v, is_inference=False, use_causal_mask=True)
        o.set_output(True)
        stats.set_output(True)
        return g, inputs
    o, d_o = g.tensor(name="o", dim=[2, 4, s_q, 16]), g.tensor(name="dO", dim=[2, 4, s_q, 16])
    stats = g.tensor(name="stats", dim=[2, 4, s_q, 1])
    for grad in g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True):
        grad.set_output(True)
    refs = _attention(False, s_q)[0].reference(inputs)
    inputs.update(o=refs["sdpa.o"].float(), dO=torch.randn(2, 4, s_q, 16), stats=refs["sdpa.stats"].float())
    return g, inputs


# (graph maker, options, what explain() shows: the config line and the reason naming the option)
FORCED = {
    "matmul": (lambda: (_mlp(), _inputs()), dg.BuildOptions(matmul_config=mm.MatmulConfig("split_k", 16, 16, 16, 4, 2,
                                                                                          split_k=3)),
               ["config: split_k 16x16x16 warps=4 stages=2 SPLIT_K=3", "forced by BuildOptions.matmul_config"]),
    "conv": (_conv, dg.BuildOptions(conv_config=mm.MatmulConfig("tiled", 32, 16, 16, 4, 2)),
             ["config: tiled 32x16x16 warps=4 stages=2", "forced by BuildOptions.conv_config"]),
    "depthwise": (lambda: _conv(groups=4), dg.BuildOptions(depthwise_config=dw_heuristics.DepthwiseConfig(
        "gather", 4, 32, 2)), ["config: gather 4x32 warps=2", "forced by BuildOptions.depthwise_config"]),
    "row_mode": (lambda: (_mlp(), _inputs()), dg.BuildOptions(row_mode="looped", row_loop_tile=16),
                 ["(looped) BLOCK_K=1 BLOCK_R=8", "forced by looped (BuildOptions.row_mode)"]),
    "row_config": (_row_sums, dg.BuildOptions(row_config=rows.RowConfig("split", 1, 8, 1, 3, 0.0)),
                   ["(split) BLOCK_K=1 BLOCK_R=8 SPLITS=3", "forced by BuildOptions.row_config"]),
    "norm_backward_programs": (_layernorm_backward, dg.BuildOptions(norm_backward_programs=3),
                               ["fused (fused) BLOCK_K=64 BLOCK_R=64 SPLITS=3", "3 programs of contiguous row blocks"]),
    "sdpa_config": (_attention, dg.BuildOptions(sdpa_config=sdpa_heuristics.AttentionConfig(16, 32, 2, 1)),
                    ["BLOCK_M=16 BLOCK_N=32", "num_warps=2", "from the BuildOptions.sdpa_config config"]),
    "sdpa_backward": (lambda: _attention(True), dg.BuildOptions(sdpa_dkdv_config=TILE, sdpa_dq_config=TILE,
                                                                sdpa_head_group=2),
                      ["dkdv: BLOCK_M=16 BLOCK_N=16", "forced by BuildOptions.sdpa_dkdv/dq_config",
                       "2 heads' tiles interleaved"]),
    "sdpa_splits": (lambda: _attention(s_q=1), dg.BuildOptions(sdpa_splits=2),
                    ["packed splits=2", "keys in 2 split(s)"]),
}


@pytest.mark.parametrize("name", sorted(FORCED))
def test_a_forced_config_reaches_its_kernel_and_explain_names_it(name):
    make, options, shown = FORCED[name]
    g, inputs = make()
    check(g, inputs, tolerance=1e-4, options=options)
    text = g.explain()
    for part in shown:
        assert part in text, (part, text)
    assert "options: " in text and "the defaults" not in text
    assert "options: the defaults" in make()[0].build().explain()


def test_as_function_builds_every_graph_with_its_options():
    """The plain graph, and the forward and backward graphs of a derivation."""
    g = _mlp()
    options = dg.BuildOptions(matmul_config=mm.MatmulConfig("tiled", 16, 16, 16, 4, 2), row_mode="looped",
                              row_loop_tile=16)
    fn = g.as_function(options=options)
    x, w = torch.randn(5, 24), torch.randn(24, 40, requires_grad=True)
    fn(x, w.detach())
    y = fn(x, w)
    y.backward(torch.randn_like(y))
    derivation, _ = fn.derivation((False, True))
    for graph in (fn._plain[0], derivation.forward, derivation.backward):
        assert graph.plan.options is options
    assert fn._plain[0].plan.launches[0].config_text.startswith("tiled 16x16x16")
    with pytest.raises(dg.ValidationError, match="options must be a dnngraph.BuildOptions"):
        g.as_function(options="fast")


class _Linear(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w)


def test_the_torch_backend_builds_with_the_options_it_is_given():
    from test_torch_backend import _compiled
    forced = dg.BuildOptions(matmul_config=mm.MatmulConfig("tiled", 16, 16, 16, 4, 2))
    x, w = torch.randn(9, 13), torch.randn(13, 11)
    out = _compiled(_Linear(), options={"build_options": forced})(x, w)
    assert torch.allclose(out, torch.relu(x @ w), atol=1e-5)
    (report,) = torch_backend.REPORTS
    (function,) = report.functions
    assert function._plain[0].plan.options is forced
    assert function._plain[0].plan.launches[0].config_text.startswith("tiled 16x16x16")
    with pytest.raises(TypeError, match="build_options must be a dnngraph.BuildOptions"):
        torch_backend.backend(None, [], options={"build_options": {"autotune": True}})


def test_a_forced_split_row_kernel_on_a_recipe_that_cannot_split_is_unsupported():
    g = dg.Graph()
    x = g.tensor(name="x", dim=[6, 40])
    g.softmax(x).set_output(True)
    with pytest.raises(dg.UnsupportedError, match="cannot split"):
        g.build(options=dg.BuildOptions(row_config=rows.RowConfig("split", 16, 1, 4, 2, 0.0)))


def test_autotuning_for_another_target_records_under_the_device_it_timed(tmp_path, monkeypatch):
    # timings taken in the interpreter must never be filed under the GPU model the plan targets
    from dnngraph.target import H200

    monkeypatch.setenv("DNNGRAPH_CACHE_DIR", str(tmp_path))
    g = dg.Graph()
    a, b = g.tensor(name="a", dim=[20, 12]), g.tensor(name="b", dim=[12, 20])
    g.matmul(a, b).set_output(True)
    g.build(options=dg.BuildOptions(autotune=True, autotune_top=2, target=H200))
    text = (tmp_path / "tuning.json").read_text()
    assert "interpreter|" in text and "H200" not in text


def test_graph_subclasses_serialize_and_differentiate_as_plain_graphs():
    class Named(dg.Graph):
        def __init__(self, label):
            super().__init__(name=label)

    g = Named("sub")
    x = g.tensor(name="x", dim=[3, 4])
    g.relu(x).set_output(True)
    assert type(Named.from_json(g.to_json())) is dg.Graph
    x_t = torch.randn(3, 4, requires_grad=True)
    g.as_function()(x_t).sum().backward()
    assert torch.equal(x_t.grad, (x_t > 0).float())


def test_explain_shows_the_autotune_count_the_build_took(monkeypatch):
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "3")
    options = dg.BuildOptions(autotune=True)
    monkeypatch.setenv("DNNGRAPH_AUTOTUNE_TOP", "6")  # changed after the build: explain still says 3
    assert options.forced() == {"autotune": True, "autotune_top": 3}
    assert dg.BuildOptions(autotune_top=3).forced() == {}
