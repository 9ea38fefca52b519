"""Which backend a build takes where several support a group, as the default build (gluon for conv
and sdpa forwards on Hopper) meets what else a build may say: forced configs of one backend,
launches for a named target executed on CPU tensors, blobs of GPU-built plans loaded where
only the interpreter runs. Gluon kernels cannot run here: its choices are asked of the registry
for a named target, and its launches lowered for "cuda" without compiling them."""
import dataclasses
import hashlib
import json
import zlib

import pytest
import torch

import dnngraph as dg
from dnngraph import shipping
from dnngraph.backends import registry
from dnngraph.backends.triton.backend import FORCED_OPTIONS, TRITON
from dnngraph.backends.triton.heuristics.depthwise import DepthwiseConfig
from dnngraph.backends.triton.heuristics.matmul import MatmulConfig
from dnngraph.backends.triton.heuristics.sdpa import AttentionConfig
from dnngraph.build import build_launches
from dnngraph.fusion import partition
from dnngraph.options import BuildOptions
from dnngraph.problems import problem_of
from dnngraph.runtime import plan as plan_module
from dnngraph.runtime.workspace import WorkspaceBudget
from dnngraph.target import H100, H200
from gluon_conv_cases import conv_graph, conv_group
from helpers import TOLERANCE, poisoned, rel_err

# a value of each option of FORCED_OPTIONS that forces something (validated by BuildOptions)
FORCING_VALUES = {
    "matmul_config": MatmulConfig("tiled", 64, 64, 32, 4, 3),
    "conv_config": MatmulConfig("tiled", 64, 64, 32, 4, 3),
    "depthwise_config": DepthwiseConfig("gather", 16, 16, 4),
    "sdpa_config": AttentionConfig(64, 64, 4, 2),
    "sdpa_dkdv_config": AttentionConfig(64, 64, 4, 2),
    "sdpa_dq_config": AttentionConfig(64, 64, 4, 2),
    "sdpa_splits": 2,
    "sdpa_head_group": 0,
    "sdpa_index_64": True,
}


def _sdpa_problem(seq: int = 4096, head_dim: int = 128, causal: bool = False):
    """A plain bf16 sdpa forward's problem: the class gluon's model ranks first from S4096 on."""
    g = dg.Graph(name="attention", io_data_type=dg.bfloat16)
    q, k, v = (g.tensor(name=name, dim=[1, 8, seq, head_dim]) for name in ("q", "k", "v"))
    o, _ = g.sdpa(q, k, v, use_causal_mask=causal)
    o.set_output(True)
    g.validate()
    (group,) = [group for group in partition(g, registry.families()) if group.kind == "sdpa"]
    return problem_of(g, group)


def _conv_problem():
    """A bf16 NHWC 3x3 conv + bias + relu that gluon's measured rate ranks first on an H100 or H200
    (ResNet-50's layer2.1.conv2: heuristics/conv_measured.py)."""
    return conv_group(conv_graph("bf16", "bias_relu", 32, 128, 28, 28, 128, 3, padding=1))[1]


def _matmul_problem():
    g = dg.Graph(name="gemm", io_data_type=dg.bfloat16)
    a, b = g.tensor(name="a", dim=[2048, 2048]), g.tensor(name="b", dim=[2048, 2048])
    g.matmul(a, b).set_output(True)
    g.validate()
    (group,) = partition(g, registry.families())
    return problem_of(g, group)


PROBLEMS = {"conv": _conv_problem, "sdpa": _sdpa_problem, "matmul": _matmul_problem}


def test_every_family_another_backend_lowers_names_the_triton_options_that_force_it():
    """The table the registry reads to keep a forced Triton config from being ranked away holds
    every family another backend may take, and only options BuildOptions has."""
    fields = {f.name for f in dataclasses.fields(BuildOptions)}
    for name, backend in registry.BACKENDS.items():
        if backend is not TRITON:
            assert set(backend.families) <= set(FORCED_OPTIONS), (name, backend.families)
    for family, options in FORCED_OPTIONS.items():
        assert set(options) <= fields and set(options) <= set(FORCING_VALUES), family


@pytest.mark.parametrize("family", sorted(FORCED_OPTIONS))
@pytest.mark.parametrize("target", [H100, H200], ids=["H100", "H200"])
def test_a_forced_triton_option_is_never_ranked_away(family, target):
    """Gluon is ranked first for these problems where nothing is forced (so the check can fail);
    each option that forces Triton's kernel of the family keeps Triton the only choice, in
    choose(), ranked(), the plan choices and autotuning alike, and the refusal says why."""
    problem = PROBLEMS[family]()
    backends = ("gluon", "triton") if family == "matmul" else registry.verified()
    plain = BuildOptions(target=target, backends=backends)
    assert registry.choose(problem, target, plain).name == "gluon"
    assert registry.refusals(problem, target, plain) == ""
    for option in FORCED_OPTIONS[family]:
        forced = dataclasses.replace(plain, **{option: FORCING_VALUES[option]})
        assert registry.choose(problem, target, forced).name == "triton", option
        assert {b.name for b, _ in registry.ranked(problem, target, forced)} == {"triton"}, option
        assert {b.name for b, _ in registry.choices(problem, target, forced)} == {"triton"}, option
        assert {b.name for b in registry.supporting(problem, target, forced)} == {"triton"}, option
        assert registry.refusals(problem, target, forced) == f"gluon: BuildOptions.{option} forces triton's kernel"


def test_options_of_other_families_leave_the_ranking_alone():
    problem = _conv_problem()
    options = BuildOptions(target=H100, sdpa_config=FORCING_VALUES["sdpa_config"], row_mode="looped")
    assert registry.choose(problem, H100, options).name == "gluon"


def test_attention_gluon_did_not_measure_faster_ranks_triton_first():
    """Below the measured sequence length gluon gives no estimate: the default order puts Triton
    first however the other pairs are estimated; at D64 both are estimated and Triton's measured
    rate is the higher."""
    short = registry.ranked(_sdpa_problem(seq=1024), H100, BuildOptions(target=H100))
    assert short[0][0].name == "triton" and {c.estimate is None for b, c in short if b.name == "gluon"} == {True}
    assert short[0][1].estimate is not None  # half the list estimated: preference still decides
    narrow = registry.ranked(_sdpa_problem(seq=4096, head_dim=64), H100, BuildOptions(target=H100))
    assert narrow[0][0].name == "triton" and all(c.estimate is not None for _, c in narrow)


def _gpu_built_plan(monkeypatch, g, options):
    """A Plan of `g` as a GPU build makes it (launches lowered for "cuda" under `options`, gluon
    ranked in), its bind (compiling) skipped: this machine compiles nothing for a GPU."""
    monkeypatch.setattr(plan_module.DeviceLaunches, "bind", lambda self, index: None)
    snapshot = g._snapshot()
    groups = partition(snapshot, registry.families(options.backends))
    launches = build_launches(snapshot, groups, torch.device("cuda"), options, WorkspaceBudget())
    return plan_module.Plan(snapshot, groups, launches, torch.device("cuda", 0), options, build_launches,
                            WorkspaceBudget())


def _conv_inputs(g) -> dict:
    found = {}
    for t in g.inputs():
        value = torch.randn(*t.dim) * (0.25 if t.name in ("x", "w") else 1.0)
        found[t.name] = torch.empty_strided(tuple(t.dim), tuple(t.stride), dtype=t.data_type.torch_dtype).copy_(value)
    return found


@pytest.mark.parametrize("target", [H100, H200], ids=["H100", "H200"])
def test_cpu_tensors_run_interpreted_launches_of_a_plan_for_a_named_target(monkeypatch, target):
    """A GPU build for a named target ranks gluon in (named first: a shape this small has no
    measured rate, so the preference order decides); the same plan executed on CPU tensors plans
    for the same target, but must run launches the interpreter can: its own, Triton's."""
    g = conv_graph("bf16", "bias_relu", 1, 16, 5, 7, 16, 3, padding=1)
    g.validate()
    plan = _gpu_built_plan(monkeypatch, g, BuildOptions(backends=("gluon", "triton"), target=target))
    assert {launch.backend for launch in plan.launches} == {"gluon"}
    inputs = _conv_inputs(g)
    out = poisoned(g.tensor_by_name(g.outputs()[0].name))
    plan.execute({**inputs, g.outputs()[0].name: out})
    assert {launch.backend for launch in plan._launches_for(torch.device("cpu")).launches} == {"triton"}
    reference = g.reference(inputs)[g.outputs()[0].name]
    assert rel_err(out, reference) < TOLERANCE[torch.bfloat16]


def _repacked(blob: bytes, change) -> bytes:
    document = json.loads(zlib.decompress(blob[len(shipping.MAGIC):].partition(b"\n")[2]))
    change(document)
    payload = json.dumps(document, sort_keys=True).encode()
    return shipping.MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + zlib.compress(payload)


def test_a_blob_with_kernels_the_interpreter_cannot_run_is_refused_on_cpu():
    """A blob built on a GPU for a named target (gluon kernels in it) names the target a CPU
    load with its options plans for too: it is refused there (or rebuilt), never run."""
    g = conv_graph("bf16", "bias_relu", 1, 16, 5, 7, 16, 3, padding=1)
    blob = g.build().serialize()

    def as_built_on_a_gpu(document):
        document["options"]["target"] = document["target"] = shipping._encoded(H100)
        document["launches"][0]["backend"] = "gluon"

    gpu_blob = _repacked(blob, as_built_on_a_gpu)
    with pytest.raises(dg.SerializationError, match="gluon kernels, which cannot run in Triton's interpreter"):
        dg.Graph.deserialize(gpu_blob)
    rebuilt = dg.Graph.deserialize(gpu_blob, rebuild=True)
    assert {launch.backend for launch in rebuilt.plan.launches} == {"triton"}
    # the same blob with Triton's kernels loads: the named target alone is no refusal on CPU

    def for_h100(document):
        document["options"]["target"] = document["target"] = shipping._encoded(H100)

    assert dg.Graph.deserialize(_repacked(blob, for_h100)).plan.launches[0].backend == "triton"


def test_a_plan_built_in_the_interpreter_for_a_named_gpu_says_why_gluon_was_left_out():
    """Built where only the interpreter runs (ahead of time, for an H100 by name), a conv gluon
    would take on the GPU runs Triton's kernel: explain() says so, and a loaded blob still does."""
    g = conv_graph("bf16", "bias_relu", 1, 16, 5, 7, 16, 3, padding=1)
    g.build(options=BuildOptions(target=H100))
    (launch,) = g.plan.launches
    assert launch.backend == "triton"
    assert launch.backend_refusals.startswith("gluon: its kernels cannot run in Triton's interpreter")
    assert "refused: gluon: its kernels cannot run" in g.explain()
    plain = conv_graph("bf16", "bias_relu", 1, 16, 5, 7, 16, 3, padding=1).build()  # for the interpreter: no GPU
    assert plain.plan.launches[0].backend_refusals == ""

    def refused_on_the_gpu(document):
        document["launches"][0]["backend_refusals"] = "gluon: a reason given where it was built"

    loaded = dg.Graph.deserialize(_repacked(plain.serialize(), refused_on_the_gpu))
    assert loaded.plan.launches[0].backend_refusals == "gluon: a reason given where it was built"
    assert "refused: gluon: a reason given where it was built" in loaded.explain()


def test_equal_backend_choices_are_equal_options_and_share_a_plan():
    """Families in any order, repeated, or all of a backend's: one spelling, one plan key."""
    assert BuildOptions(backends=("triton", "gluon:sdpa,conv")) == BuildOptions()
    assert BuildOptions(backends=["triton", "gluon:conv,sdpa,conv"]).backends == registry.verified()
    assert BuildOptions(backends=("triton", "gluon:conv,matmul,sdpa")).backends == ("triton", "gluon")
    assert BuildOptions(backends=("gluon:sdpa", "triton")).backends == ("gluon:sdpa", "triton")
    for wrong in (("triton", "gluon:"), ("triton", "gluon:conv,"), ("triton", "gluon:pooling"), ("triton", "triton:conv", "triton")):
        with pytest.raises(dg.ValidationError, match="BuildOptions.backends"):
            BuildOptions(backends=wrong)
    g = conv_graph("bf16", "bias_relu", 1, 16, 5, 7, 16, 3, padding=1)
    first = g.build(options=BuildOptions(backends=("triton", "gluon:sdpa,conv"))).plan
    again = g.build().plan
    assert again.launches is first.launches  # the plan cache's, not a second build



def test_a_gluon_kernel_compiles_and_loads_as_a_shipped_binary():
    """The shipping path's compiler (a process of its own) and loader take a gluon kernel as
    Gluon source: a plan holding one compiles ahead of time and loads its binary."""
    from dnngraph.dtypes import kernel_torch_dtype
    from dnngraph.runtime.kernel_binary import KernelBinary, compile_for, compile_request
    from gluon_conv_cases import lowered

    g = conv_graph("bf16", "bias_relu", 1, 32, 7, 6, 48, 3, padding=1)
    g.validate()
    (launch,) = lowered(g)
    dtypes = {t.uid: kernel_torch_dtype(t.data_type) for t in g.tensors}
    (binary,) = compile_for([compile_request(launch, dtypes)], (9, 0))
    assert binary.arch == 90 and "wgmma.mma_async" in binary.asm["ptx"]
    compiled = KernelBinary.from_record(binary.to_record()).load(launch.kernel)
    assert type(compiled.src).__name__ == "GluonASTSource"
    assert list(compiled.src.signature) == [argument.name for argument in launch.arguments]

# -- on a GPU (an H100 or H200: the default takes gluon there) -----------------------------------

def _hopper_target():
    from dnngraph.target import target_of

    target = target_of(torch.device("cuda", 0))
    if target.capability != (9, 0):
        pytest.skip(f"{target.name} is not a Hopper GPU: the default build takes no gluon kernel")
    return target


def _gpu_conv():
    """A conv + bias + relu the default build lowers to gluon on Hopper (a wide 1x1 inside the
    measured sizes: heuristics/conv_measured.py; small enough for the interpreter), and its CUDA
    inputs."""
    g = conv_graph("bf16", "bias_relu", 32, 64, 7, 7, 128, 1)
    inputs = {name: value.cuda() for name, value in _conv_inputs(g).items()}
    return g, inputs


def _checked(g, inputs) -> torch.Tensor:
    name = g.outputs()[0].name
    device = next(iter(inputs.values())).device
    out = poisoned(g.tensor_by_name(name), device)
    g.execute({**inputs, name: out})
    reference = g.reference({k: v.cpu() for k, v in inputs.items()})[name]
    assert rel_err(out.cpu(), reference) < TOLERANCE[torch.bfloat16]
    return out


@pytest.mark.gpu
def test_gpu_default_conv_plan_ships_its_gluon_kernel(tmp_path):
    """serialize() of a default build whose conv is gluon's, run in a fresh process that may not
    lower or compile: the gluon binary loads (and its Triton fallback ships beside it)."""
    from test_shipping import _in_fresh_process

    _hopper_target()
    g, inputs = _gpu_conv()
    g.build()
    assert [launch.backend for launch in g.plan.launches] == ["gluon"]
    here = _checked(g, inputs)
    there = _in_fresh_process(tmp_path, g.serialize(), inputs)
    assert torch.equal(here, there[g.outputs()[0].name])


@pytest.mark.gpu
def test_gpu_plan_for_a_named_target_runs_cpu_tensors_interpreted():
    """Built on the GPU for its model by name (gluon taken), executed on CUDA tensors and then
    on CPU tensors: the CPU execute runs Triton's kernels through the interpreter."""
    target = _hopper_target()
    g, inputs = _gpu_conv()
    g.build(options=BuildOptions(target=target))
    assert [launch.backend for launch in g.plan.launches] == ["gluon"]
    _checked(g, inputs)
    _checked(g, {name: value.cpu() for name, value in inputs.items()})
    assert {launch.backend for launch in g.plan._launches_for(torch.device("cpu")).launches} == {"triton"}


@pytest.mark.gpu
def test_gpu_forced_conv_config_runs_triton():
    _hopper_target()
    g, inputs = _gpu_conv()
    g.build(options=BuildOptions(conv_config=FORCING_VALUES["conv_config"]))
    assert [launch.backend for launch in g.plan.launches] == ["triton"]
    assert "BuildOptions.conv_config forces triton's kernel" in g.explain()
    _checked(g, inputs)
