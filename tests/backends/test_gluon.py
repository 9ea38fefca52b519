"""The Gluon backend (backends/gluon/): opt-in warp-specialized sm_90a matmuls.

CPU (here): every candidate config x epilogue form x operand type, plain and batched, renders and
compiles for sm_90a (tests/sm90_compile.py, Triton's compiler and ptxas, no GPU), with warp
specialization, setmaxnreg and wgmma in what it compiles to; supports() gives a reason for every
case it refuses; the registry leaves gluon out of interpreted builds, of other targets and of the
default options. GPU (@pytest.mark.gpu, an H100 or H200): results against the float64 reference,
a run under Triton's concurrency sanitizer, and explain() naming gluon.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from gluon_cases import (BATCHES, EPILOGUES, TYPES, compile_cases, graph, lowered, matmul_group)
from helpers import check, compiled_for_sm90

import dnngraph as dg
from dnngraph.backends import registry
from dnngraph.backends.contract import Backend
from dnngraph.backends.gluon.backend import (CONFIGS, GLUON, HEAVY_EPILOGUE_REGISTERS, GluonConfig,
                                             heavy_epilogue, heavy_epilogue_registers, shared_bytes)
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


def test_heavy_epilogues_are_offered_the_configs_that_do_not_spill():
    for epilogue in ("bias_row_gelu", "residual_silu", "scale_gelu_tanh"):
        _, problem = matmul_group(graph("bf16", epilogue, "plain", 1024, 1024, 1024))
        assert heavy_epilogue(problem)
        offered = [c.config for c in GLUON.candidates(problem, H100)]
        assert offered and all(heavy_epilogue_registers(c) <= HEAVY_EPILOGUE_REGISTERS for c in offered)
        assert any(c.block_n == 256 for c in offered)  # the widest tile, its epilogue in subtiles
    _, problem = matmul_group(graph("bf16", "bias", "plain", 1024, 1024, 1024))
    assert not heavy_epilogue(problem) and len(GLUON.candidates(problem, H100)) == len(CONFIGS)


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
    assert "float16 or bfloat16" in _refusal(g)

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

    g, a, b = _simple(b_dim=[64, 64], b_stride=[1, 64])  # b column-major (a transposed weight)
    g.matmul(a, b).set_output(True)
    assert "stride" in _refusal(g)

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


def test_default_options_never_choose_gluon():
    assert isinstance(GLUON, Backend) and not GLUON.interpretable and GLUON.families == {"matmul"}
    assert "gluon" in registry.names() and not GLUON.verified and registry.BACKENDS["gluon"] is GLUON
    assert BuildOptions().backends == ("triton",) == registry.verified()
    problem = _problem()
    for target in (H100, H200):
        assert registry.choose(problem, target, BuildOptions(target=target), interpreted=False).name == "triton"


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

def _inputs(g, device="cuda") -> dict:
    """Random inputs of `g` (scales kept near 1 so tanh and sigmoid see varied values)."""
    found = {}
    for t in g.tensors:
        if t.producer is None:
            dtype = t.data_type.torch_dtype
            found[t.name] = (torch.randn(*t.dim, device=device) / (4 if t.name in ("a", "b") else 1)).to(dtype)
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


CONSAN = """
import dataclasses, sys
import torch, triton
sys.path[:0] = {paths!r}
# consan's instrumentation keeps its state in scratch that Triton allocates through this
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
from gluon_cases import graph
from helpers import check
import dnngraph as dg
# the widest config (two consumers, four epilogue subtiles, two staging buffers each)
for batch, epilogue in (("plain", "bias"), ("batched", "residual_silu")):
    g = graph("bf16", epilogue, batch, m=160, n=136, k=200)
    inputs = {{t.name: (torch.randn(*t.dim, device="cuda") / 4).to(t.data_type.torch_dtype)
              for t in g.tensors if t.producer is None}}
    target = dataclasses.replace(dg.target.from_properties(torch.cuda.get_device_properties(0)), sms=2)
    check(g, inputs, dtype=torch.bfloat16, device="cuda", options=dg.BuildOptions(backends=("gluon",), target=target))
print("consan clean")
"""


@pytest.mark.gpu
def test_a_small_run_is_clean_under_the_concurrency_sanitizer(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(here)
    env = dict(os.environ, TRITON_INSTRUMENTATION_MODE="consan", DNNGRAPH_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    script = CONSAN.format(paths=[here, tests])
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "consan clean" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


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
    assert makers == {"load_partition", "mma_partition"}, makers
