"""Targets: the device model a build plans for (dnngraph/target.py).

The configs a fixed set of problems (tests/target_problems.py) gets under the H100's target are
those the heuristics chose on an H100 before targets existed, when every build read H100
constants (captured from that tree and written down here); a target is read from the driver's
properties; the H200 differs from the H100 by its bandwidth alone; a made-up GPU of 2 SMs and
100 KB of shared memory per block gets configs that fit it from every family, which run right
through the interpreter."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import dnngraph as dg
from dnngraph import target as target_module
from dnngraph.backends.triton.heuristics import conv as conv_heuristics
from dnngraph.backends.triton.heuristics import depthwise as dw_heuristics
from dnngraph.backends.triton.heuristics import matmul as mm
from dnngraph.backends.triton.heuristics import sdpa as sdpa_heuristics
from helpers import check
import target_problems

H100, H200, INTERPRETER = dg.target.H100, dg.target.H200, dg.target.INTERPRETER
TINY = dataclasses.replace(H100, name="tiny", sms=2, shared_memory=100 * 1024)

H100_CONFIGS = {
    'matmul 4096^3 bias gelu': ['persistent 128x256x64 warps=8 stages=3 grid=132'],
    'matmul 8192^3 bias gelu': ['persistent 128x256x64 warps=8 stages=3 grid=132'],
    'matmul decode 1x11008x4096': ['small_m 16x64x128 warps=4 stages=4 grid=172x1'],
    'matmul 128x128x16384 split': [
        'split_k 64x64x64 warps=4 stages=4 SPLIT_K=16',
        'split-K combine 64x128',
    ],
    'matmul 4096x14336x4096 silu backward': [
        'persistent 128x256x64 warps=8 stages=3 subtile2 tma-store tma-stores=2 grid=132',
    ],
    'matmul fp32 2048^3': ['tiled 128x128x32 warps=8 stages=3 grid=256x1'],
    'matmul tf32 2048^3': ['tiled 128x256x32 warps=8 stages=3 grid=128x1'],
    'bmm 16x512x512x64': ['persistent 128x128x64 warps=8 stages=4 grid=132'],
    'matmul fp32 x bf16 2048x4096x4096': ['tiled 128x256x64 warps=8 stages=3 grid=256x1'],
    'conv 3x3 256@14 N32': ['tiled 64x128x64 warps=4 stages=4 grid=196x1'],
    'conv 3x3 64@56 N32': ['tiled 128x64x64 warps=4 stages=4 grid=784x1'],
    'conv stem 7x7 s2 N32': ['tiled 128x64x32 warps=4 stages=4 grid=3136x1'],
    'conv 1x1 256->64 @56 N32': ['tiled 128x64x64 warps=8 stages=3 grid=784x1'],
    'conv dgrad 3x3 s2 128@28 N32': [
        'tiled 256x128x64 warps=8 stages=3 grid=98x1',
        'tiled 256x128x64 warps=8 stages=3 grid=98x1',
        'tiled 256x128x64 warps=8 stages=3 grid=98x1',
        'tiled 256x128x64 warps=8 stages=3 grid=98x1',
    ],
    'conv wgrad 3x3 64@56 N32': [
        'small_m 32x64x128 warps=4 stages=4 SPLIT_K=8',
        'split-K combine 64x128',
    ],
    'conv wgrad stem N32': [
        'small_m 64x64x64 warps=4 stages=4 SPLIT_K=64',
        'split-K combine 64x128',
    ],
    'conv + channel sums 64@56 N32': [
        'tiled 128x64x64 warps=4 stages=4 grid=784x1',
        'partial (split) BLOCK_K=64 BLOCK_R=32 SPLITS=784 num_warps=4 grid=784 K=[64] R=[100352]',
        'combine (split) BLOCK_K=8 BLOCK_R=32 SPLITS=784 num_warps=4 grid=8 K=[64] R=[100352]',
    ],
    'depthwise fprop 3x3 256@56 N32': ['gather 64x64 warps=8 grid=6272'],
    'depthwise wgrad 3x3 256@56 N32': [
        'wgrad 16x8x64 warps=8 SPLITS=66 grid=4x2x66',
        'combine 66 splits in order',
    ],
    'layernorm 16384x8192': [
        'main (one_pass) BLOCK_K=1 BLOCK_R=8192 SPLITS=1 num_warps=8 grid=16384 K=[16384] R=[8192]',
    ],
    'layernorm backward 4096x4096': [
        'fused (fused) BLOCK_K=1 BLOCK_R=4096 SPLITS=132 num_warps=16 grid=132 K=[4096] R=[4096]',
        'combine (fused) BLOCK_K=8 BLOCK_R=1 SPLITS=132 num_warps=4 grid=512 K=[4096] R=[4096]',
    ],
    # the chunked fused backward (heuristics/rows.py FUSED_LOOP_CHUNK) since 2026-11-29
    'layernorm backward 4096x14336': [
        'fused (fused) BLOCK_K=1 BLOCK_R=4096 SPLITS=132 num_warps=16 grid=132 K=[4096] R=[14336]',
        'combine (fused) BLOCK_K=8 BLOCK_R=1 SPLITS=132 num_warps=4 grid=1792 K=[14336] R=[4096]',
    ],
    'softmax 4096x32768': [
        'main (looped) BLOCK_K=1 BLOCK_R=2048 SPLITS=1 num_warps=8 grid=4096 K=[4096] R=[32768]',
    ],
    'softmax 64x262144': ['main (looped) BLOCK_K=1 BLOCK_R=8192 SPLITS=1 num_warps=16 grid=64 K=[64] R=[262144]'],
    'batchnorm NHWC 32x256x56x56': [
        'partial (split) BLOCK_K=64 BLOCK_R=32 SPLITS=196 num_warps=4 grid=784 K=[256] R=[100352]',
        'combine (split) BLOCK_K=8 BLOCK_R=32 SPLITS=196 num_warps=4 grid=32 K=[256] R=[100352]',
        'apply (split) BLOCK_K=64 BLOCK_R=32 SPLITS=196 num_warps=4 grid=784 K=[256] R=[100352]',
    ],
    'batchnorm backward NHWC 32x256x56x56': [
        'partial (split) BLOCK_K=64 BLOCK_R=32 SPLITS=131 num_warps=4 grid=524 K=[256] R=[100352]',
        'combine (split) BLOCK_K=8 BLOCK_R=32 SPLITS=131 num_warps=4 grid=32 K=[256] R=[100352]',
        'apply (split) BLOCK_K=64 BLOCK_R=32 SPLITS=131 num_warps=4 grid=524 K=[256] R=[100352]',
    ],
    'column sum 100352x64': [
        'partial (split) BLOCK_K=64 BLOCK_R=32 SPLITS=784 num_warps=4 grid=784 K=[64] R=[100352]',
        'combine (split) BLOCK_K=8 BLOCK_R=32 SPLITS=784 num_warps=4 grid=8 K=[64] R=[100352]',
    ],
    'sdpa D128 B4 H32 S4096 causal': [
        'BLOCK_M=128 BLOCK_N=64 BLOCK_D=128 BLOCK_DV=128 num_warps=8 num_stages=3 grid=[256, 16]',
    ],
    'sdpa D64 B8 H16 S2048': [
        'BLOCK_M=128 BLOCK_N=64 BLOCK_D=64 BLOCK_DV=64 num_warps=8 num_stages=3 grid=[16, 128]',
    ],
    'sdpa D256 B2 H16 S4096': [
        'BLOCK_M=128 BLOCK_N=64 BLOCK_D=256 BLOCK_DV=256 num_warps=8 num_stages=2 grid=[32, 32]',
    ],
    'sdpa decode B64 H32:8 Skv8192 D128': [
        'BLOCK_M=16 BLOCK_N=64 BLOCK_D=128 BLOCK_DV=128 num_warps=4 num_stages=3 grid=[1, 512] packed splits=1 chunk=8192',
    ],
    'sdpa decode B2 H32:8 Skv8192 D128': [
        'BLOCK_M=16 BLOCK_N=64 BLOCK_D=128 BLOCK_DV=128 num_warps=4 num_stages=3 grid=[16, 16] packed splits=16 chunk=512',
        'combine: BLOCK_R=16 SPLITS=16 grid=[4]',
    ],
    'sdpa backward D128 B4 H32 S4096 causal': [
        'delta: BLOCK_M=64 BLOCK_N=16 BLOCK_D=128 BLOCK_DV=128 num_warps=4 num_stages=1 grid=[64, 128]',
        'dkdv: BLOCK_M=64 BLOCK_N=128 BLOCK_D=128 BLOCK_DV=128 num_warps=8 num_stages=3 grid=[256, 16]',
        'dq: BLOCK_M=64 BLOCK_N=64 BLOCK_D=128 BLOCK_DV=128 num_warps=4 num_stages=2 grid=[512, 16]',
    ],
    'softcap attention B4 H16 S2048 D128': [
        'BLOCK_M=64 BLOCK_N=32 BLOCK_D=128 BLOCK_DV=128 num_warps=4 num_stages=2 grid=[32, 64]',
    ],
    'pointwise 16384x8192': ['BLOCK_R=1 BLOCK_C=1024 num_warps=2 grid=131072 space=[16384, 8192]'],
    # re-chosen from the H200's measured tiles (heuristics/pooling.py FORWARD_TILE_ELEMENTS)
    'max pooling 3x3 s2 64@112 N32': ['BLOCK_R=8 BLOCK_C=64 num_warps=2 grid=12544 vector=c rows=nhw'],
}


def _chosen(target) -> dict:
    return target_problems.chosen_configs(lambda g: g.build(options=dg.BuildOptions(target=target)))


def test_the_h100_target_chooses_what_the_h100_constants_chose():
    assert _chosen(H100) == H100_CONFIGS


def test_the_interpreter_plans_as_an_h100_but_for_the_attention_tiles():
    """The interpreter's target has the H100's numbers; its capability None gives attention
    its small interpreter tiles."""
    chosen = _chosen(INTERPRETER)
    apart = {name for name in chosen if chosen[name] != H100_CONFIGS[name]}
    assert apart and all(name.startswith(("sdpa", "softcap")) for name in apart), apart


# --- read from the driver ------------------------------------------------------------------------
def _properties(**changes) -> SimpleNamespace:
    """What torch.cuda.get_device_properties says of an H200 (with `changes`)."""
    fields = dict(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, shared_memory_per_block=49152,
                  shared_memory_per_block_optin=232448, regs_per_multiprocessor=65536,
                  max_threads_per_multi_processor=2048)
    return SimpleNamespace(**{**fields, **changes})


def test_a_target_is_read_from_the_driver_properties():
    assert target_module.from_properties(_properties()) == H200
    assert target_module.from_properties(_properties(name="NVIDIA H100 80GB HBM3")) == H100
    a100 = target_module.from_properties(_properties(name="NVIDIA A100-SXM4-80GB", major=8, multi_processor_count=108,
                                                     shared_memory_per_block_optin=166912))
    assert (a100.name, a100.capability, a100.sms, a100.shared_memory) == ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912)
    assert a100.facts == target_module.DEFAULT_FACTS  # a model the table lacks: the H100's facts
    older = _properties()
    del older.shared_memory_per_block_optin, older.regs_per_multiprocessor
    fallback = target_module.from_properties(older)  # an older torch: a block's default share
    assert (fallback.shared_memory, fallback.registers) == (49152, 65536)


def test_the_target_of_a_device_is_its_drivers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _properties(multi_processor_count=100 + index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    target_module._target_of_index.cache_clear()
    try:
        assert target_module.target_of("cuda:0").sms == 100 and target_module.target_of(2).sms == 102
        assert target_module.target_of("cuda").sms == 101 and target_module.target_of().sms == 101  # current
        assert target_module.target_of("cuda:0").bandwidth == H200.bandwidth
        assert target_module.target_of(torch.device("cpu")) is INTERPRETER
    finally:
        target_module._target_of_index.cache_clear()


@pytest.mark.parametrize("field, value", [("sms", 0), ("shared_memory", 1.5), ("registers", True),
                                          ("max_grid", (1, 2)), ("capability", (9,)), ("name", ""),
                                          ("facts", None)])
def test_a_malformed_target_is_a_validation_error_naming_the_field(field, value):
    with pytest.raises(dg.ValidationError, match=f"Target.{field}"):
        dataclasses.replace(H100, **{field: value})
    with pytest.raises(dg.ValidationError, match="ModelFacts.bandwidth"):
        dataclasses.replace(H100.facts, bandwidth=float("inf"))


def test_h100_and_h200_differ_by_their_bandwidth_alone():
    """The same die, SM count and shared memory; the H200's HBM3e is faster. Plans for the two
    are apart, and the memory-bound choices follow the bandwidth."""
    assert dataclasses.replace(H200, name=H100.name, facts=H100.facts) == H100
    assert H200.bandwidth == pytest.approx(4.8e12 * 3.0 / 3.35) and H100.bandwidth == 3.0e12
    assert all(H200.peak(dot) == H100.peak(dot) for dot in target_module.DOTS)
    chosen = _chosen(H200)
    assert chosen != H100_CONFIGS
    g = target_problems.pointwise(64, 64).build(options=dg.BuildOptions(target=H100))
    other = target_problems.pointwise(64, 64).build(options=dg.BuildOptions(target=H200))
    assert other.plan.launches is not g.plan.launches and "4.3 TB/s" in other.plan.launches[0].reason


# --- a small GPU ---------------------------------------------------------------------------------
def _matmul_problems():
    """Matmul problems of every variant's reach: decode, split-K, TMA squares, wide epilogues, fp32."""
    return [mm.MatmulProblem(1, 4096, 4096, 4096, "bf16", 2, 2, 2, True, "row", "row", "add,gelu"),
            mm.MatmulProblem(1, 4096, 14336, 4096, "bf16", 2, 2, 8, True, "row", "row", "silu_backward", 4),
            mm.MatmulProblem(1, 1, 11008, 4096, "bf16", 2, 2, 2, True, "row", "row"),
            mm.MatmulProblem(1, 128, 128, 16384, "bf16", 2, 2, 2, True, "row", "row"),
            mm.MatmulProblem(16, 512, 512, 64, "fp8", 1, 1, 2, True, "row", "col"),
            mm.MatmulProblem(1, 2048, 2048, 2048, "fp32", 4, 4, 4, False, "row", "row"),
            mm.MatmulProblem(1, 2048, 2048, 2048, "tf32", 4, 4, 4, True, "row", "col")]


def test_every_matmul_and_conv_candidate_fits_a_small_gpu():
    for problem in _matmul_problems():
        ranked = mm.schedule(problem, TINY).ranked
        assert ranked and all(mm.shared_bytes(c, problem) <= TINY.shared_memory for c in ranked), problem
        assert all(mm.programs_per_sm(c, problem, TINY) >= 1 for c in ranked)
        big = mm.schedule(problem, H100).ranked
        assert any(mm.shared_bytes(c, problem) > TINY.shared_memory for c in big) or problem.dot == "fp32"
    conv = conv_heuristics.ConvProblem(1, 32 * 14 * 14, 256, 256, 9, "bf16", 2, 2, 2, "nhwc")
    assert all(mm.shared_bytes(c, conv.padded(c.block_k)) <= TINY.shared_memory
               for c in conv_heuristics.schedule(conv, TINY).ranked)
    wgrad = mm.MatmulProblem(9, 64, 64, 32 * 56 * 56, "bf16", 2, 2, 4, False, "strided", "strided")
    assert all(c.split_k == 1 for c in conv_heuristics.wgrad_schedule(wgrad, TINY).ranked[:1])  # 2 SMs: no split
    with pytest.raises(dg.UnsupportedError, match="no tile fits"):
        mm.schedule(_matmul_problems()[0], dataclasses.replace(TINY, shared_memory=1024))


def test_attention_tiles_fit_a_small_gpu():
    for head_dim, causal, bytes_ in ((128, True, 2), (256, False, 2), (64, True, 2), (128, True, 4)):
        problem = sdpa_heuristics.AttentionProblem(4, 32, 8, 4096, 4096, head_dim, head_dim, bytes_, causal, 2, causal)
        forward = sdpa_heuristics.schedule(problem, TINY)
        d = forward.block_d
        assert sdpa_heuristics._shared_bytes(forward.config, problem, d, d) <= TINY.shared_memory
        backward = sdpa_heuristics.backward_schedule(problem, TINY)
        for which in ("dkdv", "dq"):
            assert sdpa_heuristics._backward_shared_bytes(which, backward.configs[which], problem, d, d) \
                <= TINY.shared_memory, (head_dim, which, backward.configs[which])
    # the H100's tables fit the H100 as they are: the fit changes nothing there
    for table in (sdpa_heuristics.GPU_BACKWARD_TILES, sdpa_heuristics.GPU_BACKWARD_TILES_CAUSAL,
                  sdpa_heuristics.GPU_BACKWARD_TILES_FP32):
        for width, dkdv, dq in table:
            problem = sdpa_heuristics.AttentionProblem(1, 1, 1, 64, 64, width, width,
                                                       4 if table is sdpa_heuristics.GPU_BACKWARD_TILES_FP32 else 2,
                                                       True, 0, True)
            for which, tile in (("dkdv", dkdv), ("dq", dq)):
                assert sdpa_heuristics._backward_shared_bytes(which, sdpa_heuristics.AttentionConfig(*tile),
                                                              problem, width, width) <= H100.shared_memory
    decode = sdpa_heuristics.AttentionProblem(2, 32, 8, 1, 8192, 128, 128, 2)
    assert sdpa_heuristics.schedule(decode, H100).splits == 16 and sdpa_heuristics.schedule(decode, TINY).splits == 1


def test_the_small_gpu_sizes_every_family_by_its_two_sms():
    """Persistent GEMMs launch one program per SM; the fused norm backward, the column splits,
    the depthwise wgrad splits and the decode splits size their grids for 2 SMs; every build of
    the problem set succeeds (each grid checked against the target's limits)."""
    chosen = _chosen(TINY)
    persistent = [text for texts in chosen.values() for text in texts if text.startswith("persistent")]
    assert persistent and all(text.endswith("grid=2") for text in persistent)
    assert "SPLITS=4" in chosen["layernorm backward 4096x4096"][0]  # 2 per SM at least 32 rows each
    assert "SPLITS=12" in chosen["column sum 100352x64"][0]  # 6 programs per SM
    assert "SPLITS=1 " in chosen["depthwise wgrad 3x3 256@56 N32"][0] + " "
    assert "splits=1 " in chosen["sdpa decode B2 H32:8 Skv8192 D128"][0]
    gather = dw_heuristics.GatherProblem("conv_fprop", 32 * 56 * 56, 256, 9, 1, 2, 1.0, True, 10**8)
    assert dw_heuristics.schedule(gather, TINY).config.kernel == "gather"


def _tiny(**fields) -> dg.BuildOptions:
    return dg.BuildOptions(target=TINY, **fields)


def test_the_small_gpus_configs_run_right():
    """Built for the small GPU (its GPU tables and TMA included), through the interpreter."""
    g = dg.Graph(name="tiny_mlp")
    a, w, b = g.tensor(name="a", dim=[3, 40, 64]), g.tensor(name="w", dim=[64, 48]), g.tensor(name="b", dim=[1, 48])
    h = g.gelu(g.add(g.matmul(a, w), b))
    g.layernorm(h, g.tensor(name="s", dim=[1, 1, 48]), None)[0].set_output(True).set_name("y")
    persistent = mm.MatmulConfig("persistent", 32, 16, 16, 4, 2)  # one program per SM: two here
    check(g, {"a": torch.randn(3, 40, 64), "w": torch.randn(64, 48) / 8, "b": torch.randn(1, 48),
              "s": torch.rand(1, 1, 48) + 0.5}, tolerance=1e-4, options=_tiny(matmul_config=persistent))
    assert g.plan.launches[0].config_text.endswith("grid=2") and g.plan.target is TINY
    g = dg.Graph(name="tiny_attention")
    q, k, v = (g.tensor(name=n, dim=[2, 2, 37, 16]) for n in ("q", "k", "v"))
    g.sdpa(q, k, v, use_causal_mask=True)[0].set_output(True).set_name("o")
    check(g, {n: torch.randn(2, 2, 37, 16) for n in "qkv"}, tolerance=1e-4, options=_tiny())
    g = dg.Graph(name="tiny_norm_backward")
    x, dy, s = (g.tensor(name=n, dim=d) for n, d in (("x", [37, 33]), ("dy", [37, 33]), ("s", [1, 33])))
    m, i = (g.tensor(name=n, dim=[37, 1]) for n in ("m", "i"))
    for out in g.layernorm_backward(dy, x, s, m, i):
        out.set_output(True)
    check(g, {"x": torch.randn(37, 33), "dy": torch.randn(37, 33), "s": torch.randn(1, 33), "m": torch.randn(37, 1),
              "i": torch.rand(37, 1) + 0.5}, tolerance=1e-4, options=_tiny())
    assert [launch.config_text.split()[0] for launch in g.plan.launches] == ["fused", "combine"]


def test_a_conv_no_tile_fits_is_unsupported_not_a_raw_error():
    tiny = dataclasses.replace(target_module.H100, shared_memory=1024)
    g = dg.Graph()
    x, w = g.tensor(name="x", dim=[1, 8, 10, 10]), g.tensor(name="w", dim=[16, 8, 3, 3])
    g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1]).set_output(True)
    with pytest.raises(dg.UnsupportedError, match="no tile fits"):
        g.build(options=dg.BuildOptions(target=tiny))
