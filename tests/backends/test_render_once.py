"""Rendering becomes a launch in one place: every Triton builder renders a KernelSource and hands
it to runtime/launch.py's launch_of, which loads it (load_kernel) and makes the KernelLaunch.
No builder loads a kernel itself, and the launches are what they were before that was so."""
import pathlib
import re

import dnngraph as dg
from dnngraph.backends.contract import KernelSource
from dnngraph.backends.triton.codegen.pointwise import KernelArgument
from dnngraph.runtime import kernel_files
from dnngraph.runtime.launch import launch_of

BACKENDS = pathlib.Path(__file__).resolve().parents[2] / "dnngraph" / "backends"


LOADS = re.compile(r"\bload_kernel\s*\(|import .*\bload_kernel\b")  # a call or an import, not a mention


def test_no_builder_loads_a_kernel_itself():
    """No module of any backend loads a kernel: each hands its KernelSource to launch_of."""
    builders = sorted(BACKENDS.rglob("*.py"))
    assert len(builders) > 5 and any(path.parent.name == "gluon" for path in builders)
    found = [f"{path.relative_to(BACKENDS)}:{number}" for path in builders
             for number, line in enumerate(path.read_text().splitlines(), 1) if LOADS.search(line)]
    assert not found, f"builders calling load_kernel instead of launch_of: {found}"


def test_launch_of_loads_the_source_under_its_stem():
    stem = "dnngraph_render_once_probe"
    text = f"import triton\n\n\n@triton.jit\ndef {stem}(x_ptr, N: tl.constexpr):\n    pass\n"
    text = text.replace("import triton\n", "import triton\nimport triton.language as tl\n")
    arguments = [KernelArgument("tensor", "x_ptr", 7), KernelArgument("constexpr", "N", 4)]
    launch = launch_of("group", KernelSource(stem, text, arguments), 3, 2, "config", "reason", num_stages=1)
    name, _ = kernel_files.named_source(text, stem)
    assert launch.kernel.__name__ == name and launch.source_path.name == f"{name}.py"
    assert launch.arguments is arguments and launch.grid == (3, 1, 1) and launch.num_warps == 2
    assert (launch.config_text, launch.reason, launch.num_stages, launch.group) == ("config", "reason", 1, "group")
    assert launch.slots == ((0, 7),) and launch.template == [None, 4]


def _matmul(m, k, n):
    g = dg.Graph(io_data_type=dg.float32)
    a, w = g.tensor(name="a", dim=[m, k]), g.tensor(name="w", dim=[k, n])
    g.relu(g.matmul(a, w)).set_output(True)
    return g.build().plan.launches


def _sdpa(s_q, s_kv, **options):
    g = dg.Graph(io_data_type=dg.float16)
    q = g.tensor(name="q", dim=[2, 4, s_q, 32])
    k, v = g.tensor(name="k", dim=[2, 4, s_kv, 32]), g.tensor(name="v", dim=[2, 4, s_kv, 32])
    o, _ = g.sdpa(q, k, v, use_causal_mask=True)
    o.set_output(True)
    return g.build(options=dg.BuildOptions(**options) if options else None).plan.launches


def _sdpa_backward():
    g = dg.Graph(io_data_type=dg.float16)
    q, k, v, o, d_o = (g.tensor(name=n, dim=[2, 4, 64, 32]) for n in ("q", "k", "v", "o", "do"))
    stats = g.tensor(name="stats", dim=[2, 4, 64, 1], data_type=dg.float32)
    for t in g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True):
        if t is not None:
            t.set_output(True)
    return g.build().plan.launches


def _named(launches) -> list:
    """(kernel name less its content digest, config text) of each launch: the digest changes
    with any edit of the kernels' text, which other tests judge by what the kernels compute."""
    return [(re.sub(r"_[0-9a-f]{16}$", "", launch.kernel.__name__), launch.config_text) for launch in launches]


# (kernel name, config text) of each launch, as the builders gave them before rendering went
# through launch_of
def test_matmul_and_sdpa_launches_are_unchanged():
    assert _named(_matmul(64, 16, 64)) == [
        ("dnngraph_matmul_relu", "small_m 16x64x16 warps=4 stages=4 grid=4x1")]
    assert _named(_matmul(512, 4096, 64)) == [
        ("dnngraph_matmul_relu", "split_k 64x64x32 warps=4 stages=4 SPLIT_K=16"),
        ("dnngraph_matmul_relu_combine", "split-K combine 64x128")]
    tiles = "BLOCK_M=16 BLOCK_N=16 BLOCK_D=32 BLOCK_DV=32 num_warps=1 num_stages=1"
    assert _named(_sdpa(64, 64)) == [("dnngraph_sdpa_sdpa", tiles + " grid=[32, 1]")]
    assert _named(_sdpa(1, 512, sdpa_splits=4)) == [
        ("dnngraph_sdpa_sdpa_split", tiles + " grid=[4, 8] packed splits=4 chunk=128"),
        ("dnngraph_sdpa_sdpa_combine", "combine: BLOCK_R=16 SPLITS=4 grid=[1]")]
    assert _named(_sdpa_backward()) == [
        ("dnngraph_sdpa_sdpa_backward_delta", "delta: " + tiles + " grid=[4, 8]"),
        ("dnngraph_sdpa_sdpa_backward_dkdv", "dkdv: " + tiles + " grid=[32, 1]"),
        ("dnngraph_sdpa_sdpa_backward_dq", "dq: " + tiles + " grid=[32, 1]")]
