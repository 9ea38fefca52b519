"""The Gluon backend (backends/gluon/): opt-in warp-specialized sm_90a matmuls.

CPU (here): every candidate config x epilogue form x operand type, plain and batched, and the
K-major B variants (16-bit; fp8 with per-tensor scales), renders and compiles for sm_90a (tests/sm90_compile.py, Triton's compiler and ptxas, no GPU), with warp
specialization, setmaxnreg and wgmma in what it compiles to; supports() gives a reason for every
case it refuses; the registry leaves gluon out of interpreted builds, of other targets and of the
default options. GPU (@pytest.mark.gpu, an H100 or H200): results against the float64 reference,
a run under Triton's concurrency sanitizer, and explain() naming gluon.

The ping-pong schedule (PINGPONG_CONFIGS, given from outside: candidates() does not offer them
yet) compiles over a subset of those cases (its own test, beside the long one above) and, on a
GPU, matches the reference over epilogues, batch forms, K-major B and fp8, and programs of 1, 2
and odd numbers of tiles.

The epilogue walks its column subtiles in a loop (the default) or unrolled (GluonConfig.
epilogue_loop): the loop holds the epilogue's code once per consumer (its SASS MUFU count, on
CPU), and both walks match the reference on a GPU over 4, 2 and 1 subtiles, pointer stores and
ping-pong.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from gluon_cases import (BATCHES, EPILOGUES, FP8_TYPES, KMAJOR_EPILOGUES, PINGPONG_VARIANTS, TYPES, compile_cases,
                         graph, lowered, matmul_group, pingpong_cases)
from helpers import CONSAN_HEAD, check, clean_under_consan, compiled_for_sm90

import dnngraph as dg
from dnngraph.backends import registry
from dnngraph.backends.contract import Backend
from dnngraph.backends.gluon.backend import (CONFIGS, GLUON, HEAVY_EPILOGUE_ACCUMULATORS, LAUNCH_SECONDS,
                                             LOOPED_EPILOGUE_REGISTERS, PINGPONG_CONFIGS, GluonConfig,
                                             accumulators_per_thread, heavy_epilogue, looped_epilogue, shared_bytes)
from dnngraph.options import BuildOptions
from dnngraph.target import H100, H200, INTERPRETER

GLUON_FIRST = ("gluon", "triton")


# -- (a) every variant compiles for sm_90a ---------------------------------------------------------

def test_every_variant_compiles_for_sm90a_with_warp_specialization():
    expected = sum(1 for _ in compile_cases())
    output = compiled_for_sm90("gluon_cases:compile_cases", timeout=1800)
    assert f"compiled {expected} kernels for sm_90" in output
    facts = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2])
             for line in output.splitlines() if line.startswith("facts ")}
    assert len(facts) == expected
    for label, found in facts.items():
        assert found["warp_specialize"], label  # the producer and consumer partitions
        assert found["setmaxnreg"] > 0, label  # registers moved from the producer to the consumers
        assert found["wgmma"] > 0 and found["tma_load"] > 0, label
        assert found["shared"] <= H100.shared_memory, label
        assert found["global_scratch"] > 0, label  # device-side descriptors
        assert found["spill_stores"] == 0, label  # the consumers' accumulators fit their registers
    # the ptr-store variants (fp32 output beside a 128x256 ring) are among them
    assert any(label.endswith("/ptr") for label in facts) and any(label.endswith("/tma") for label in facts)
    # and the K-major ones: 16-bit and fp8 (e4m3, e5m2), plain and batched
    for prefix in ("kmajor/bf16/none/plain/", "kmajor/fp16/bias/batched/", "kmajor/e4m3/scale_gelu_tanh/batched/",
                   "kmajor/e4m3/bias/batched_b_shared/", "kmajor/e5m2/none/plain/"):
        assert any(label.startswith(prefix) for label in facts), prefix


def test_the_compile_cases_meet_every_pair_of_type_config_epilogue_and_batch():
    """compile_cases compiles each epilogue x batch form (at every config offered) in one 16-bit
    type: each type must still meet every config, epilogue and batch form, or a failure of one
    type could hide behind the other's cases."""
    cases = [label.split("/") for label, _, _ in compile_cases() if not label.startswith("kmajor/")]
    assert {(epilogue, batch) for _, epilogue, batch, _, _ in cases} == {(e, b) for e in EPILOGUES for b in BATCHES}
    configs = {config for *_, config, _ in cases}
    for position, values in ((1, EPILOGUES), (2, BATCHES), (3, configs)):
        pairs = {(case[0], case[position]) for case in cases}
        assert pairs == {(t, value) for t in TYPES for value in values}, (position, sorted(pairs))


def _facts(output: str, kind: str = "facts") -> dict:
    """label -> the json of each `kind LABEL ...{json}` line sm90_compile printed (facts, sass)."""
    return {line.split(" ", 2)[1]: json.loads(line[line.index("{"):])
            for line in output.splitlines() if line.startswith(kind + " ")}


def test_a_looped_epilogue_holds_its_code_once():
    """The epilogue's column subtiles in a loop (GluonConfig.epilogue_loop) put its code in the
    kernel once per consumer, unrolled once per subtile: the GELUs' transcendentals (SASS MUFU,
    beside the bias kernel's own) are SPLITS times fewer, the kernel smaller, no spills either
    way (the loop keeps the whole accumulator live through it). bf16 4096^3, 128x256 (4 subtiles
    of 64) and 128x128 (2)."""
    output = compiled_for_sm90("gluon_cases:code_size_test_cases", timeout=1200, env={"SM90_SASS": "1"})
    facts, sass = _facts(output), _facts(output, "sass")
    assert len(sass) == 13 and set(sass) == set(facts)
    # asked for a loop past its registers: unrolled, each accumulator's code once, as at e64 unrolled
    wide = "code/bias_gelu_tanh/128x256s4/e128/loop"
    assert sass[wide]["mufu"] == sass["code/bias_gelu_tanh/128x256s4/e64/unrolled"]["mufu"]
    assert all(found["spill_stores"] == 0 for found in facts.values()), facts
    for config in ("128x256s4", "128x128s6"):
        splits = {"128x256s4": 4, "128x128s6": 2}[config]
        for epilogue in ("bias_gelu_tanh", "bias_gelu"):
            def code(walk, epilogue=epilogue, config=config):
                label = f"code/{epilogue}/{config}/e64/{walk}"
                return sass[label]["mufu"] - sass[f"code/bias/{config}/e64/{walk}"]["mufu"], sass[label]
            looped, looped_sass = code("loop")
            unrolled, unrolled_sass = code("unrolled")
            assert looped > 0 and unrolled == splits * looped, (epilogue, config, looped, unrolled)
            assert looped_sass["instructions"] < unrolled_sass["instructions"], (epilogue, config)


def test_pingpong_variants_compile_for_sm90a_without_spills():
    """Every ping-pong config over bf16 epilogues (plain and batched) and one fp8 e4m3 K-major
    case: warp specialization, setmaxnreg, wgmma, no spills, within shared memory."""
    expected = sum(1 for _ in pingpong_cases())
    assert expected == len(PINGPONG_VARIANTS) * len(PINGPONG_CONFIGS)
    output = compiled_for_sm90("gluon_cases:pingpong_cases", timeout=1200)
    assert f"compiled {expected} kernels for sm_90" in output
    facts = _facts(output)
    assert len(facts) == expected
    for label, found in facts.items():
        assert found["warp_specialize"] and found["setmaxnreg"] > 0, label
        assert found["wgmma"] > 0 and found["tma_load"] > 0 and found["global_scratch"] > 0, label
        assert found["shared"] <= H100.shared_memory, label
        assert found["spill_stores"] == 0, label  # a whole tile's accumulator beside a subtile's epilogue
    assert any(label.startswith("pingpong/kmajor/e4m3/") for label in facts)


def test_pingpong_configs_are_taken_from_outside_but_not_offered_yet(monkeypatch):
    import dnngraph.backends.gluon.backend as gluon_backend
    g = graph("bf16", "residual_silu", "batched", 300, 264, 136)  # a heavy epilogue: ping-pong takes it
    _, problem = matmul_group(g)
    assert not any(c.config.pingpong for c in GLUON.candidates(problem, H100))
    for config in PINGPONG_CONFIGS:
        assert config.pingpong and config.consumers == 2 and accumulators_per_thread(config) <= 128
        (launch,) = lowered(g, config)
        assert launch.config_text.split(" grid=")[0].endswith("tma-store schedule=pingpong")
        values = _constexprs(launch)
        assert values["PINGPONG"] is True and values["CONSUMERS"] == 2 and values["BLOCK_M"] == config.block_m
        # each consumer stages its own whole-tile subtiles: twice the cooperative rows
        cooperative = dataclasses.replace(config, schedule="cooperative")
        staged = 2 * config.block_m * config.epilogue_n * 2  # two buffers a consumer, bf16
        assert shared_bytes(config, 2, 2) - shared_bytes(cooperative, 2, 2) == staged
    (launch,) = lowered(g)
    assert _constexprs(launch)["PINGPONG"] is False and "schedule" not in launch.config_text
    monkeypatch.setattr(gluon_backend, "OFFER_PINGPONG", True)  # once measured
    offered = [c.config for c in GLUON.candidates(problem, H100)]
    assert sum(c.pingpong for c in offered) == len(PINGPONG_CONFIGS)
    with pytest.raises(ValueError, match="two consumers"):
        GluonConfig(128, 128, 64, 4, 1, schedule="pingpong")
    with pytest.raises(ValueError, match="schedule"):
        GluonConfig(128, 128, 64, 4, 2, schedule="stream-k")


def test_the_epilogue_walk_is_plain_data_in_the_config():
    """GluonConfig.epilogue_loop reaches the kernel as EPILOGUE_LOOP, from candidates() (the loop)
    and from outside (either walk, cooperative and ping-pong); config_text names the unrolled walk."""
    g = graph("bf16", "bias_row_gelu", "batched", 300, 264, 136)
    _, problem = matmul_group(g)
    assert all(c.config.epilogue_loop for c in GLUON.candidates(problem, H100))
    (launch,) = lowered(g)
    assert _constexprs(launch)["EPILOGUE_LOOP"] is True and "unrolled" not in launch.config_text
    for config in (CONFIGS[2], PINGPONG_CONFIGS[0]):
        for loop in (True, False):
            (launch,) = lowered(g, dataclasses.replace(config, epilogue_loop=loop))
            values = _constexprs(launch)
            assert values["EPILOGUE_LOOP"] is loop and values["PINGPONG"] is config.pingpong
            assert values["EPILOGUE_N"] == config.epilogue_n
            assert ("epilogue-unrolled" in launch.config_text) is not loop


def test_a_heavy_epilogue_loops_where_its_registers_allow(monkeypatch):
    """Every config offered to a heavy epilogue, and every ping-pong one, keeps the looped walk;
    one whose accumulators and two subtiles pass LOOPED_EPILOGUE_REGISTERS (128x256 in 128-column
    subtiles) runs a heavy epilogue unrolled, a light one looped."""
    import dnngraph.backends.gluon.backend as gluon_backend
    heavy_graph = graph("bf16", "bias_row_gelu", "batched", 300, 520, 136)
    _, problem = matmul_group(heavy_graph)
    assert heavy_epilogue(problem)
    for config in [c.config for c in GLUON.candidates(problem, H100)] + list(PINGPONG_CONFIGS):
        assert looped_epilogue(config, heavy=True), config.text
    wide = GluonConfig(128, 256, 64, 4, 2, epilogue_n=128)
    assert accumulators_per_thread(wide) + 2 * 64 > LOOPED_EPILOGUE_REGISTERS
    monkeypatch.setattr(gluon_backend, "CONFIGS", (wide, ))
    monkeypatch.setattr(gluon_backend, "HEAVY_EPILOGUE_ACCUMULATORS", 1 << 20)
    light_graph = graph("bf16", "bias", "batched", 300, 520, 136)
    # (graph, walk from outside, walk offered): a light epilogue is offered unrolled (offered_walk)
    for g, outside, offered in ((heavy_graph, False, False), (light_graph, True, False)):
        for launch, loops in ((lowered(g, wide)[0], outside), (lowered(g)[0], offered)):
            assert _constexprs(launch)["EPILOGUE_LOOP"] is loops
            assert ("epilogue-unrolled" in launch.config_text) is not loops


def test_candidates_fit_shared_memory_and_carry_estimates():
    for type_name in TYPES:
        for epilogue in ("none", "relu_cast"):
            _, problem = matmul_group(graph(type_name, epilogue, "plain", 1024, 1024, 1024))
            offered = GLUON.candidates(problem, H100)
            assert offered and all(c.backend == "gluon" and c.estimate > 0 for c in offered)
            estimates = [c.estimate for c in offered]
            assert estimates == sorted(estimates)
            out_bytes = problem.outputs[0].data_type.itemsize
            for candidate in offered:
                assert shared_bytes(candidate.config, 2, out_bytes) <= H100.shared_memory
                assert GLUON.estimate(problem, candidate.config, H100) == candidate.estimate


def _constexprs(launch) -> dict:
    return {a.name: a.value for a in launch.arguments if a.kind == "constexpr"}


def test_k_major_b_is_read_through_its_transposed_view():
    for batch in ("plain", "batched", "batched_b_shared"):
        g = graph("bf16", "bias", batch, 300, 264, 136, k_major=True)
        _, problem = matmul_group(g)
        assert GLUON.supports(problem, H100) is True
        (launch,) = lowered(g)
        values = _constexprs(launch)
        assert values["B_K_MAJOR"] is True and not values["SCALE_A"] and not values["SCALE_B"]
        ints = {a.name: a.value for a in launch.arguments if a.kind == "int"}
        # the descriptor is over B^T [N, K]: its rows are K apart, batches K * N
        assert ints["b_stride_row"] == 136 and ints["b_stride_batch"] == (136 * 264 if batch == "batched" else 0)
        assert not any(a.name.startswith("scale_") for a in launch.arguments)
    (launch,) = lowered(graph("bf16", "bias", "batched", 300, 264, 136))
    assert _constexprs(launch)["B_K_MAJOR"] is False


def test_fp8_takes_k_major_b_scales_and_block_k_128():
    for type_name in FP8_TYPES:
        g = graph(type_name, "bias", "batched", 300, 264, 512, k_major=True)
        _, problem = matmul_group(g)
        assert GLUON.supports(problem, H100) is True
        offered = GLUON.candidates(problem, H100)
        assert offered and all(c.config.block_k == 128 for c in offered)
        for candidate in offered:  # the ring's bytes are the 16-bit configs' (half the elements' size)
            assert shared_bytes(candidate.config, 1, 2) == shared_bytes(
                dataclasses.replace(candidate.config, block_k=64), 2, 2)
        (launch,) = lowered(g)
        values = _constexprs(launch)
        assert values["B_K_MAJOR"] and values["SCALE_A"] and values["SCALE_B"] and values["BLOCK_K"] == 128
        names = [a.name for a in launch.arguments if a.kind == "tensor"]
        assert names[:5] == ["a_ptr", "b_ptr", "c_ptr", "scale_a_ptr", "scale_b_ptr"]
        # a config from outside with CONFIGS' 16-bit BLOCK_K is taken at fp8's
        (launch,) = lowered(g, GluonConfig(128, 256, 64, 3, 2))
        assert "128x256x128 stages=3 consumers=2" in launch.config_text
    # the model runs fp8 at the target's fp8 peak
    for type_name, dot in (("e4m3", "fp8"), ("bf16", "bf16")):
        _, problem = matmul_group(graph(type_name, "none", "plain", 8192, 8192, 8192, k_major=True))
        config = GLUON.candidates(problem, H100)[0].config
        seconds = 2.0 * 8192 ** 3 / H100.peak(dot)
        tiles = -(-8192 // config.block_m) * -(-8192 // config.block_n)
        efficiency = tiles / (-(-tiles // H100.sms) * H100.sms)
        assert GLUON.estimate(problem, config, H100) == pytest.approx(seconds / efficiency + LAUNCH_SECONDS)


def test_heavy_epilogues_take_the_wider_tiles_only_looped_and_light_ones_unrolled():
    """A heavy epilogue is offered a tile past HEAVY_EPILOGUE_ACCUMULATORS only with its subtiles
    in a loop (offered_walk), and every config in a loop; a light one every config, unrolled."""
    for epilogue in ("bias_row_gelu", "residual_silu", "scale_gelu_tanh"):
        _, problem = matmul_group(graph("bf16", epilogue, "plain", 1024, 1024, 1024))
        assert heavy_epilogue(problem)
        offered = [c.config for c in GLUON.candidates(problem, H100)]
        assert any(accumulators_per_thread(c) > HEAVY_EPILOGUE_ACCUMULATORS for c in offered)
        assert offered and all(c.epilogue_loop for c in offered)
    _, problem = matmul_group(graph("bf16", "bias", "plain", 1024, 1024, 1024))
    offered = [c.config for c in GLUON.candidates(problem, H100)]
    assert not heavy_epilogue(problem) and len(offered) == len(CONFIGS)
    assert not any(c.epilogue_loop for c in offered)


def test_lower_gives_one_persistent_launch_with_an_unaligned_fallback():
    g = graph("bf16", "bias", "batched", 300, 264, 136)
    (launch,) = lowered(g)
    tiles = 3 * 3 * 3  # batch x ceil(300/128) x ceil(264/128) for the 128x128 configs
    assert launch.grid == (min(tiles, H100.sms), 1, 1) and launch.num_warps == 4
    assert "gluon warp-specialized" in launch.reason and " us " in launch.reason
    assert launch.alternative is not None  # the Triton tiled kernel where a pointer is unaligned
    source = open(launch.source_path).read()
    assert "lib.matmul(" in source and "bias" not in source.split('"""', 2)[2]  # no user names in code
    forced = GluonConfig(128, 256, 64, 3, 2)
    (launch,) = lowered(g, forced)
    assert "128x256x64 stages=3 consumers=2 epilogue-n=64" in launch.config_text
    # a config from outside is taken as candidates() offers it (store path, fit), or refused
    fp32_out = graph("bf16", "relu_cast", "plain", 300, 264, 136)
    (launch,) = lowered(fp32_out, GluonConfig(128, 256, 64, 4, 2))
    assert "128x256x64 stages=4 consumers=2 epilogue-n=64 pointer-store" in launch.config_text  # no room to stage
    heavy = graph("bf16", "residual_silu", "plain", 300, 264, 136)
    with pytest.raises(dg.UnsupportedError, match="is not one this problem can run"):
        lowered(heavy, GluonConfig(128, 128, 64, 4, 1))


# -- (b) what it refuses, and when the registry asks it ------------------------------------------

def _refusal(g, target=H100) -> str:
    _, problem = matmul_group(g)
    answer = GLUON.supports(problem, target)
    assert isinstance(answer, str) and answer.startswith("gluon"), answer
    return answer


def _simple(t=dg.bfloat16, m=64, n=64, k=64, a_dim=None, b_dim=None, b_stride=None):
    g = dg.Graph(name="refused", io_data_type=t)
    a = g.tensor(name="a", dim=a_dim or [m, k], data_type=t)
    b = g.tensor(name="b", dim=b_dim or [k, n], stride=b_stride, data_type=t)
    return g, a, b


def test_supports_names_why_it_refuses():
    g, a, b = _simple()
    g.matmul(a, b).set_output(True)
    _, problem = matmul_group(g)
    assert GLUON.supports(problem, H100) is True and GLUON.supports(problem, H200) is True
    assert "capability" in _refusal(g, dataclasses.replace(H100, capability=(10, 0)))
    assert "capability" in _refusal(g, dataclasses.replace(H100, capability=(8, 0)))
    assert "capability" in _refusal(g, INTERPRETER)

    g, a, b = _simple(t=dg.float32)
    g.matmul(a, b).set_output(True)
    assert "float16, bfloat16, float8_e4m3 or float8_e5m2" in _refusal(g)

    g = dg.Graph(name="mixed", io_data_type=dg.float16)
    a = g.tensor(name="a", dim=[64, 64], data_type=dg.float16)
    b = g.tensor(name="b", dim=[64, 64], data_type=dg.bfloat16)
    g.matmul(a, b).set_output(True)
    assert "one type" in _refusal(g)

    g, a, b = _simple()
    g.matmul(g.relu(a), b).set_output(True)
    assert "prologue" in _refusal(g)

    g, a, b = _simple()
    g.exp(g.matmul(a, b)).set_output(True)
    assert "op exp" in _refusal(g)

    g, a, b = _simple(b_dim=[64, 64], b_stride=[128, 2])  # neither N nor K contiguous
    g.matmul(a, b).set_output(True)
    assert "stride 2, not 1" in _refusal(g) and "nor is K contiguous" in _refusal(g)

    g, a, b = _simple(b_dim=[64, 64], b_stride=[1, 68])  # K-major, B^T's rows 136 bytes apart
    g.matmul(a, b).set_output(True)
    assert "K-major" in _refusal(g) and "16 bytes" in _refusal(g)

    g, a, b = _simple(k=20)  # A's rows 40 bytes apart
    g.matmul(a, b).set_output(True)
    assert "16 bytes" in _refusal(g)

    g, a, b = _simple(a_dim=[2, 2, 64, 64], b_dim=[2, 2, 64, 64])
    g.matmul(a, b).set_output(True)
    assert "rank" in _refusal(g) or "batch dimension" in _refusal(g)

    g, a, b = _simple()
    column = g.tensor(name="col", dim=[64, 1], data_type=dg.bfloat16)
    g.add(g.matmul(a, b), column).set_output(True)
    assert "row vectors" in _refusal(g)

    g, a, b = _simple()
    c = g.matmul(a, b)
    c.set_output(True)
    g.relu(c).set_output(True)
    assert "one output" in _refusal(g)

    g, a, b = _simple()
    g.cast(g.matmul(a, b), dg.int32).set_output(True)
    assert "int32" in _refusal(g)


def _fp8(a_type=dg.float8_e4m3, b_type=dg.float8_e4m3, k_major=True, scale_type=dg.float32):
    g = dg.Graph(name="fp8", io_data_type=dg.bfloat16)
    a = g.tensor(name="a", dim=[64, 64], data_type=a_type)
    b = g.tensor(name="b", dim=[64, 64], stride=[1, 64] if k_major else None, data_type=b_type)
    sa = g.tensor(name="sa", dim=[1], data_type=scale_type)
    sb = g.tensor(name="sb", dim=[1, 1], data_type=dg.float32)
    g.matmul(a, b, scale_a=sa, scale_b=sb).set_output(True)
    return g


def test_supports_names_why_it_refuses_an_fp8_matmul():
    _, problem = matmul_group(_fp8())
    assert GLUON.supports(problem, H100) is True
    refused = _refusal(_fp8(k_major=False))  # wgmma reads fp8 B K-major only
    assert "fp8 wgmma reads B K-major" in refused and "row-major" in refused
    assert "one type" in _refusal(_fp8(b_type=dg.float8_e5m2))  # e4m3 x e5m2
    assert "one type" in _refusal(_fp8(b_type=dg.bfloat16))
    assert "scales" in _refusal(_fp8(scale_type=dg.float8_e4m3)) and "float8_e4m3" in _refusal(
        _fp8(scale_type=dg.float8_e4m3))
    # the matmul op takes per-tensor scales only (one element); a problem holding a block scale
    # (a future op's) is refused by name
    blocked = dataclasses.replace(problem, operands=tuple(
        dataclasses.replace(o, dims=(2, 1), strides=(1, 1)) if o.role == "scale_a" else o for o in problem.operands))
    assert "per-tensor scales" in GLUON.supports(blocked, H100)
    with pytest.raises(dg.ValidationError, match="per-tensor scale"):
        g, a, b = _simple(t=dg.float8_e4m3)
        g.matmul(a, b, scale_a=g.tensor(name="sa", dim=[1, 2], data_type=dg.float32))


def _problem():
    return matmul_group(graph("bf16", "bias", "plain", 512, 512, 512))[1]


def test_the_registry_skips_gluon_on_interpreted_builds_and_other_targets():
    problem = _problem()
    options = BuildOptions(backends=GLUON_FIRST, target=H100)
    assert [b.name for b in registry.supporting(problem, H100, options, interpreted=True)] == ["triton"]
    assert registry.choose(problem, H100, options, interpreted=True).name == "triton"
    sm100 = dataclasses.replace(H100, capability=(10, 0))
    assert registry.choose(problem, sm100, options, interpreted=False).name == "triton"
    with pytest.raises(dg.UnsupportedError, match="gluon: its kernels cannot run in Triton's interpreter"):
        registry.supporting(problem, H100, BuildOptions(backends=("gluon",)), interpreted=True)


def test_default_options_never_choose_gluon_for_matmul():
    """gluon is verified for sdpa and conv only: the default takes it as "gluon:conv,sdpa", so matmuls go to
    Triton unless a build names gluon alone."""
    assert isinstance(GLUON, Backend) and not GLUON.interpretable and GLUON.families == {"matmul", "sdpa", "conv"}
    assert "gluon" in registry.names() and not GLUON.verified and registry.BACKENDS["gluon"] is GLUON
    assert registry.verified_families(GLUON) == {"conv", "sdpa"}
    assert BuildOptions().backends == ("triton", "gluon:conv,sdpa") == registry.verified()
    problem = _problem()
    for target in (H100, H200):
        assert registry.choose(problem, target, BuildOptions(target=target), interpreted=False).name == "triton"
        assert [b.name for b in registry.supporting(problem, target, BuildOptions(target=target))] == ["triton"]
    with pytest.raises(dg.UnsupportedError, match="gluon: taken for sdpa only"):
        registry.supporting(problem, H100, BuildOptions(backends=("gluon:sdpa",), target=H100))


def test_opting_in_ranks_gluon_where_it_supports_the_problem():
    problem = _problem()
    options = BuildOptions(backends=GLUON_FIRST, target=H100)
    pairs = registry.ranked(problem, H100, options, interpreted=False)
    assert {b.name for b, _ in pairs} == {"gluon", "triton"}
    assert registry.choose(problem, H100, options, interpreted=False) is pairs[0][0]
    # the model ranks them together (both give estimates); gluon alone is always gluon
    assert registry.choose(problem, H100, BuildOptions(backends=("gluon",)), interpreted=False).name == "gluon"
    # a problem gluon refuses goes to triton
    g, a, b = _simple(t=dg.float32)
    g.matmul(a, b).set_output(True)
    refused = matmul_group(g)[1]
    assert registry.choose(refused, H100, options, interpreted=False).name == "triton"


def test_a_cpu_build_with_gluon_first_runs_triton_in_the_interpreter():
    g = graph("bf16", "bias", "plain", 40, 24, 16)
    inputs = {"a": torch.randn(40, 16).bfloat16(), "b": torch.randn(16, 24).bfloat16(),
              "bias": torch.randn(24).bfloat16()}
    check(g, inputs, dtype=torch.bfloat16, options=BuildOptions(backends=GLUON_FIRST))
    assert {launch.backend for launch in g.plan.launches} == {"triton"}


# -- (c) on a GPU (H100 / H200) --------------------------------------------------------------------

FP8_SCALES = {"scale_a": 0.05, "scale_b": 0.02}


def _inputs(g, device="cuda") -> dict:
    """Random inputs of `g` with its strides (scales kept near 1 so tanh and sigmoid see varied
    values). fp8 operands: randn x 16, well inside e4m3's range (448) and e5m2's, and the
    per-tensor scales of FP8_SCALES (the products, about 16 * 16 * sqrt(K), back near 1-10)."""
    found = {}
    for t in g.tensors:
        if t.producer is None:
            dtype = t.data_type.torch_dtype
            if t.name in FP8_SCALES:
                value = torch.full(tuple(t.dim), FP8_SCALES[t.name], device=device)
            elif t.name in ("a", "b"):
                value = torch.randn(*t.dim, device=device) * (16 if t.data_type in FP8_TYPES.values() else 0.25)
            else:
                value = torch.randn(*t.dim, device=device)
            found[t.name] = torch.empty_strided(tuple(t.dim), tuple(t.stride), dtype=dtype,
                                                device=device).copy_(value.to(dtype))
    return found


def _gluon_options():
    return BuildOptions(backends=("gluon",))


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", sorted(TYPES))
@pytest.mark.parametrize("epilogue", sorted(EPILOGUES))
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("k", [8, 64, 392])
def test_gluon_matches_the_reference(type_name, epilogue, batch, k):
    """M, N off the tiles; K of one partial step, one full step, and past the ring (392 = 6.1
    steps of 64); 3 SMs, so programs loop over tiles and the ring's phases wrap across them."""
    g = graph(type_name, epilogue, batch, m=200, n=136, k=k)
    out_type = g.outputs()[0].data_type.torch_dtype
    tolerance = {torch.float32: 1e-2}.get(out_type)  # bf16 / fp16 inputs, fp32 output: the inputs' rounding
    check(g, _inputs(g), dtype=TYPES[type_name].torch_dtype, device="cuda", tolerance=tolerance,
          options=BuildOptions(backends=GLUON_FIRST, target=_few_sms()))
    assert {launch.backend for launch in g.plan.launches} == {"gluon"}


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", sorted(TYPES))
@pytest.mark.parametrize("epilogue", KMAJOR_EPILOGUES + ("residual_silu", "relu_cast"))
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("k", [8, 64, 392])
def test_gluon_with_k_major_b_matches_the_reference(type_name, epilogue, batch, k):
    """B given K-major (B^T dense, as a transposed weight): loaded through a descriptor over the
    [N, K] view, read by wgmma through the transposed shared-memory view."""
    g = graph(type_name, epilogue, batch, m=200, n=136, k=k, k_major=True)
    out_type = g.outputs()[0].data_type.torch_dtype
    tolerance = {torch.float32: 1e-2}.get(out_type)
    inputs = _inputs(g)
    assert inputs["b"].stride()[-2] == 1  # K-major as given
    check(g, inputs, dtype=TYPES[type_name].torch_dtype, device="cuda", tolerance=tolerance,
          options=BuildOptions(backends=GLUON_FIRST, target=_few_sms()))
    assert {launch.backend for launch in g.plan.launches} == {"gluon"}
    assert _constexprs(g.plan.launches[0])["B_K_MAJOR"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("type_name", sorted(FP8_TYPES))
@pytest.mark.parametrize("epilogue", KMAJOR_EPILOGUES)
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("k", [16, 128, 784])
def test_gluon_fp8_with_scales_matches_the_reference(type_name, epilogue, batch, k):
    """fp8 A and K-major B with per-tensor fp32 scales, bf16 output. K of one partial step, one
    full step (128) and past the ring (784 = 6.1 steps). Tolerance: the reference reads the same
    fp8 values exactly, so the error is the bf16 store's rounding (at most 2^-9 of each value)
    plus the fp8 tensor cores' accumulation (sums kept to about 2^-13 inside each wgmma, added in
    fp32); a relative norm error near 2e-3 is expected, and bf16's 1.6e-2 (check's) bounds it."""
    g = graph(type_name, epilogue, batch, m=200, n=136, k=k, k_major=True)
    check(g, _inputs(g), dtype=torch.bfloat16, device="cuda",
          options=BuildOptions(backends=GLUON_FIRST, target=_few_sms()))
    assert {launch.backend for launch in g.plan.launches} == {"gluon"}
    values = _constexprs(g.plan.launches[0])
    assert values["SCALE_A"] and values["SCALE_B"] and values["BLOCK_K"] == 128


@pytest.mark.gpu
def test_fp8_on_a_larger_problem_with_one_scale():
    """Every fp8 config's tiles over M, N off them, K of many steps; scale_b absent."""
    g = dg.Graph(name="fp8_one_scale", io_data_type=dg.bfloat16)
    a = g.tensor(name="a", dim=[1000, 1024], data_type=dg.float8_e4m3)
    b = g.tensor(name="b", dim=[1024, 1032], stride=[1, 1024], data_type=dg.float8_e4m3)
    g.matmul(a, b, scale_a=g.tensor(name="scale_a", dim=[1], data_type=dg.float32)).set_output(True)
    check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", options=_gluon_options())
    values = _constexprs(g.plan.launches[0])
    assert values["SCALE_A"] and not values["SCALE_B"] and values["B_K_MAJOR"]


def _few_sms(device="cuda"):
    """The device's target with 3 SMs: 3 persistent programs, each looping over many tiles (the
    ring's phases wrap across tiles)."""
    return dataclasses.replace(dg.target.from_properties(torch.cuda.get_device_properties(device)), sms=3)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=lambda i: CONFIGS[i].text.replace(" ", "_"))
def test_every_config_matches_the_reference_on_a_larger_problem(index, monkeypatch):
    # every config forced in turn (candidates() offers only this one); K differs per config so no
    # plan of another config is taken from the plan cache
    import dnngraph.backends.gluon.backend as gluon_backend
    config = CONFIGS[index]
    monkeypatch.setattr(gluon_backend, "CONFIGS", (config,))
    g = graph("bf16", "bias", "batched", m=1000, n=1032, k=520 + 8 * index)  # a light epilogue: every config
    check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", options=_gluon_options())
    assert config.text.split(" tma")[0].split(" pointer")[0] in g.plan.launches[0].config_text


@pytest.mark.gpu
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_few_programs_looping_over_many_tiles(batch):
    g = graph("fp16", "residual_silu", batch, m=520, n=264, k=392)
    options = BuildOptions(backends=("gluon",), target=_few_sms())
    check(g, _inputs(g), dtype=torch.float16, device="cuda", options=options)
    assert g.plan.launches[0].grid == (3, 1, 1)


@pytest.mark.gpu
def test_the_pointer_store_path_with_two_consumers(monkeypatch):
    """fp32 output at 128x256 (its staging would not fit beside the ring): masked pointer stores
    from both consumers, M and N off the tiles, programs looping over tiles."""
    import dnngraph.backends.gluon.backend as gluon_backend
    monkeypatch.setattr(gluon_backend, "CONFIGS", (GluonConfig(128, 256, 64, 4, 2),))
    g = graph("bf16", "relu_cast", "batched", m=300, n=520, k=264)
    check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", tolerance=1e-2,
          options=BuildOptions(backends=GLUON_FIRST, target=_few_sms()))
    assert "pointer-store" in g.plan.launches[0].config_text


# (id, config, type, epilogue, batch, m, n, k) of the epilogue-walk cases: 4, 2 and 1 column
# subtiles, a whole-tile operand loaded per subtile, the pointer stores (an fp32 output at
# 128x256) and a ping-pong consumer's; N off the tiles, so a last tile's subtiles are partly and
# wholly out of bounds; heavy epilogues at 128x256 (the heavy-epilogue filter lifted)
WALK_CASES = (
    ("128x256_gelu", GluonConfig(128, 256, 64, 4, 2), "bf16", "bias_row_gelu", "batched", 300, 520, 264),
    ("128x256_gelu_tanh", GluonConfig(128, 256, 64, 3, 2), "fp16", "scale_gelu_tanh", "plain", 257, 776, 136),
    ("128x128_residual", GluonConfig(128, 128, 64, 6, 2), "bf16", "residual_silu", "batched", 300, 328, 200),
    ("128x128_one_subtile", GluonConfig(128, 128, 64, 4, 2, epilogue_n=128), "bf16", "bias_row_gelu", "plain",
     300, 328, 200),
    ("128x256_pointer_store", GluonConfig(128, 256, 64, 4, 2), "bf16", "relu_cast", "batched", 300, 520, 264),
    ("pingpong_gelu", PINGPONG_CONFIGS[0], "bf16", "bias_row_gelu", "batched", 301, 264, 392),
)


@pytest.mark.gpu
@pytest.mark.parametrize("loop", [True, False], ids=["loop", "unrolled"])
@pytest.mark.parametrize("case", WALK_CASES, ids=[case[0] for case in WALK_CASES])
def test_both_epilogue_walks_match_the_reference(case, loop, monkeypatch):
    """The epilogue's column subtiles in a loop (GluonConfig.epilogue_loop, the default) and
    unrolled: results against the reference, 3 SMs (each program's staging buffers reused across
    tiles), a NaN in a row of `a` carried through its output row."""
    import dnngraph.backends.gluon.backend as gluon_backend
    from dnngraph.runtime.plan_cache import PLANS
    _, config, type_name, epilogue, batch, m, n, k = case
    config = dataclasses.replace(config, epilogue_loop=loop)
    monkeypatch.setattr(gluon_backend, "CONFIGS", () if config.pingpong else (config, ))
    monkeypatch.setattr(gluon_backend, "PINGPONG_CONFIGS", (config, ) if config.pingpong else ())
    monkeypatch.setattr(gluon_backend, "OFFER_PINGPONG", config.pingpong)
    monkeypatch.setattr(gluon_backend, "HEAVY_EPILOGUE_ACCUMULATORS", 1 << 20)
    # the config's own walk offered, light epilogues too (offered_walk unrolls those)
    monkeypatch.setattr(gluon_backend, "offered_walk", gluon_backend.looped_epilogue)
    PLANS.clear()  # the forced config's plan, not one cached under the other walk
    g = graph(type_name, epilogue, batch, m=m, n=n, k=k)
    inputs = _inputs(g)
    inputs["a"].view(-1, k)[1, 0] = float("nan")
    tolerance = {torch.float32: 1e-2}.get(g.outputs()[0].data_type.torch_dtype)
    outputs = check(g, inputs, dtype=TYPES[type_name].torch_dtype, device="cuda", tolerance=tolerance,
                    options=BuildOptions(backends=("gluon", ), target=_few_sms()))
    (launch,) = g.plan.launches
    values = _constexprs(launch)
    assert launch.backend == "gluon" and values["EPILOGUE_LOOP"] is loop
    assert (values["BLOCK_N"], values["EPILOGUE_N"], values["PINGPONG"]) == (config.block_n, config.epilogue_n,
                                                                             config.pingpong)
    assert ("pointer-store" in launch.config_text) == (epilogue == "relu_cast")
    (output, ) = outputs.values()
    assert torch.isnan(output.reshape(-1, n)[1]).all()  # row 1 of the first batch


@pytest.mark.gpu
def test_explain_names_gluon_and_one_kernel_per_graph():
    # gluon alone: with ("gluon", "triton") the registry takes whichever the models rank first
    g = graph("fp16", "bias_row_gelu", "plain", m=256, n=512, k=128)
    check(g, _inputs(g), dtype=torch.float16, device="cuda", options=_gluon_options())
    assert len(g.plan.launches) == 1
    text = g.explain()
    assert [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("  backend:")] == ["gluon"]


@pytest.mark.gpu
def test_an_unaligned_operand_takes_the_triton_fallback():
    g = graph("bf16", "bias", "plain", m=130, n=64, k=64)
    inputs = _inputs(g)
    storage = torch.empty(130 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    inputs["a"] = storage[1:].view(130, 64).copy_(inputs["a"])  # 2 bytes past an aligned address
    check(g, inputs, dtype=torch.bfloat16, device="cuda", options=_gluon_options())


def _forcing_pingpong(monkeypatch, config):
    """Builds offer `config` (a ping-pong one) alone; the plan cache forgets plans of others."""
    import dnngraph.backends.gluon.backend as gluon_backend
    from dnngraph.runtime.plan_cache import PLANS
    monkeypatch.setattr(gluon_backend, "CONFIGS", ())
    monkeypatch.setattr(gluon_backend, "PINGPONG_CONFIGS", (config, ))
    monkeypatch.setattr(gluon_backend, "OFFER_PINGPONG", True)
    PLANS.clear()


def _check_pingpong(g, dtype, target=None, tolerance=None):
    check(g, _inputs(g), dtype=dtype, device="cuda", tolerance=tolerance,
          options=BuildOptions(backends=("gluon", ), target=target or _few_sms()))
    (launch,) = g.plan.launches
    assert launch.backend == "gluon" and _constexprs(launch)["PINGPONG"] is True
    return launch


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(PINGPONG_CONFIGS)))
@pytest.mark.parametrize("epilogue", ("none", "bias", "bias_row_gelu", "scale_gelu_tanh", "residual_silu",
                                      "relu_cast"))
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("k", [8, 392])
def test_pingpong_matches_the_reference(index, epilogue, batch, k, monkeypatch):
    """Ping-pong: M odd, N off the tiles, K of one partial step and past the ring; 3 SMs, so
    each program loops over odd and even numbers of tiles (the order barriers' phases wrap)."""
    _forcing_pingpong(monkeypatch, PINGPONG_CONFIGS[index])
    g = graph("bf16", epilogue, batch, m=201, n=136, k=k)
    tolerance = {torch.float32: 1e-2}.get(g.outputs()[0].data_type.torch_dtype)
    _check_pingpong(g, torch.bfloat16, tolerance=tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(PINGPONG_CONFIGS)))
@pytest.mark.parametrize("type_name", ("fp16", "e4m3"))
@pytest.mark.parametrize("batch", ("plain", "batched"))
def test_pingpong_with_k_major_b_and_fp8_matches_the_reference(index, type_name, batch, monkeypatch):
    _forcing_pingpong(monkeypatch, PINGPONG_CONFIGS[index])
    k = 784 if type_name in FP8_TYPES else 392
    g = graph(type_name, "scale_gelu_tanh", batch, m=201, n=264, k=k, k_major=True)
    launch = _check_pingpong(g, TYPES.get(type_name, dg.bfloat16).torch_dtype)
    assert _constexprs(launch)["B_K_MAJOR"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [1, 2, 5, 7])
def test_pingpong_tile_counts_per_program(tiles, monkeypatch):
    """One program (one SM) over 1 tile (consumer 1 idle), 2, and odd counts 5 and 7 (consumer 0
    takes the last tile; its last order arrival is never waited for); K past the ring."""
    config = PINGPONG_CONFIGS[0]
    _forcing_pingpong(monkeypatch, config)
    g = graph("bf16", "bias_row_gelu", "plain", m=config.block_m * tiles - 3, n=config.block_n, k=392 + 8 * tiles)
    launch = _check_pingpong(g, torch.bfloat16, target=dataclasses.replace(_few_sms(), sms=1))
    assert launch.grid == (1, 1, 1)


@pytest.mark.gpu
def test_pingpong_on_a_larger_problem_with_every_config(monkeypatch):
    for index, config in enumerate(PINGPONG_CONFIGS):
        _forcing_pingpong(monkeypatch, config)
        g = graph("bf16", "bias_row_gelu", "batched", m=1000, n=1032, k=520 + 8 * index)
        check(g, _inputs(g), dtype=torch.bfloat16, device="cuda", options=_gluon_options())
        assert "schedule=pingpong" in g.plan.launches[0].config_text


CONSAN = CONSAN_HEAD + """from gluon_cases import graph
from helpers import check
import dnngraph as dg
# bias: the widest config (two consumers, four epilogue subtiles, two staging buffers each),
# its light epilogue unrolled; residual_silu (a heavy epilogue): its subtiles walked in a loop
for batch, epilogue in (("plain", "bias"), ("batched", "residual_silu")):
    g = graph("bf16", epilogue, batch, m=160, n=136, k=200)
    inputs = {{t.name: (torch.randn(*t.dim, device="cuda") / 4).to(t.data_type.torch_dtype)
              for t in g.tensors if t.producer is None}}
    target = dataclasses.replace(dg.target.from_properties(torch.cuda.get_device_properties(0)), sms=2)
    check(g, inputs, dtype=torch.bfloat16, device="cuda", options=dg.BuildOptions(backends=("gluon",), target=target))
# the ping-pong schedule (its first config alone): 3 x 2 tiles of 128 x 128 on the 2 programs,
# 3 each, an odd count (consumer 0 takes two, consumer 1 one)
from dnngraph.backends.gluon import backend as gluon_backend
from dnngraph.runtime.plan_cache import PLANS
gluon_backend.CONFIGS, gluon_backend.OFFER_PINGPONG = (), True
gluon_backend.PINGPONG_CONFIGS = gluon_backend.PINGPONG_CONFIGS[:1]
PLANS.clear()
g = graph("bf16", "bias_row_gelu", "plain", m=328, n=136, k=200)
inputs = {{t.name: (torch.randn(*t.dim, device="cuda") / 4).to(t.data_type.torch_dtype)
          for t in g.tensors if t.producer is None}}
check(g, inputs, dtype=torch.bfloat16, device="cuda", options=dg.BuildOptions(backends=("gluon",), target=target))
assert "schedule=pingpong" in g.plan.launches[0].config_text
print("consan clean")
"""


@pytest.mark.gpu
def test_a_small_run_is_clean_under_the_concurrency_sanitizer(tmp_path):
    clean_under_consan(CONSAN, __file__, tmp_path)


def test_each_partition_makes_the_descriptors_it_copies_through():
    """A device-side descriptor is acquired (the tensormap proxy fence) only by the warps that
    make it: the producer makes A's and B's, each consumer C's, and the kernel body none."""
    import ast
    import inspect

    from dnngraph.backends.gluon import library

    tree = ast.parse(inspect.getsource(library))
    makers = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
              for call in ast.walk(node) if isinstance(call, ast.Call)
              and getattr(call.func, "id", None) == "operand_descriptor"}
    assert makers == {"load_partition", "mma_partition", "pingpong_partition"}, makers
