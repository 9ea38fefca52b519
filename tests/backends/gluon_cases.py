"""Matmul groups the Gluon backend lowers, for the sm_90a compile test (tests/sm90_compile.py)
and the GPU tests of test_gluon.py: every candidate config x epilogue form x operand type, plain
and batched (B shared by every batch, and B batched); then K-major B (16-bit, and fp8 with
per-tensor scales) over a few epilogues."""
from __future__ import annotations

import dataclasses

import torch

import dnngraph as dg
from dnngraph.backends import registry
from dnngraph.backends.contract import BuildContext
from dnngraph.backends.gluon.backend import CONFIGS, GLUON, PINGPONG_CONFIGS, GluonConfig
from dnngraph.backends.contract import Candidate
from dnngraph.fusion import partition
from dnngraph.problems import problem_of
from dnngraph.target import H100

TYPES = {"bf16": dg.bfloat16, "fp16": dg.float16}
FP8_TYPES = {"e4m3": dg.float8_e4m3, "e5m2": dg.float8_e5m2}  # operands; the output and epilogue bf16
ALL_TYPES = {**TYPES, **FP8_TYPES}
# the epilogues the K-major and fp8 variants compile with (the plain, a row operand, a heavy one)
KMAJOR_EPILOGUES = ("none", "bias", "scale_gelu_tanh")

# epilogue form -> builds the epilogue on the matmul value `c` (g: the graph, dims: c's dims)
def _bias(g, c, dims, t):
    return g.add(c, g.tensor(name="bias", dim=[dims[-1]], data_type=t))


def _bias_row_gelu(g, c, dims, t):
    return g.gelu(g.add(c, g.tensor(name="bias", dim=[1, dims[-1]], data_type=t)))


def _scale_tanh_gelu(g, c, dims, t):
    return g.gelu_tanh(g.mul(c, g.tensor(name="s", dim=[1], data_type=dg.float32)))


def _residual_silu(g, c, dims, t):
    return g.sub(g.silu(c), g.tensor(name="r", dim=list(dims), data_type=t))


def _div_sigmoid_tanh(g, c, dims, t):
    return g.tanh(g.sigmoid(g.div(c, g.tensor(name="d", dim=[dims[-1]], data_type=t))))


def _relu_cast(g, c, dims, t):
    return g.cast(g.relu(c), dg.float32)


EPILOGUES = {"none": None, "bias": _bias, "bias_row_gelu": _bias_row_gelu, "scale_gelu_tanh": _scale_tanh_gelu,
             "residual_silu": _residual_silu, "div_sigmoid_tanh": _div_sigmoid_tanh, "relu_cast": _relu_cast}
# batch shapes: (batch or None, b batched)
BATCHES = {"plain": (None, False), "batched_b_shared": (3, False), "batched": (3, True)}


def graph(type_name: str, epilogue: str, batch: str, m: int = 200, n: int = 136, k: int = 72,
          k_major: bool = False):
    """The graph of one case: out = epilogue(a @ b), M and N off the tiles, K a multiple of 8.
    k_major: B [.., K, N] with K contiguous (B^T dense). fp8 operands (FP8_TYPES) take K-major B,
    per-tensor scales scale_a and scale_b (fp32) and a bf16 output (K a multiple of 16 there)."""
    t = ALL_TYPES[type_name]
    fp8 = type_name in FP8_TYPES
    io = dg.bfloat16 if fp8 else t
    count, b_batched = BATCHES[batch]
    g = dg.Graph(name="gluon_case", io_data_type=io)
    lead = [count] if count else []
    a = g.tensor(name="a", dim=lead + [m, k], data_type=t)
    b_lead = lead if b_batched else []
    b_stride = ([k * n] if b_lead else []) + [1, k] if k_major else None
    b = g.tensor(name="b", dim=b_lead + [k, n], stride=b_stride, data_type=t)
    scales = {}
    if fp8:
        scales = {"scale_a": g.tensor(name="scale_a", dim=[1], data_type=dg.float32),
                  "scale_b": g.tensor(name="scale_b", dim=[1], data_type=dg.float32)}
    c = g.matmul(a, b, name="mm", **scales)
    dims = lead + [m, n]
    out = EPILOGUES[epilogue](g, c, dims, io) if EPILOGUES[epilogue] else c
    out.set_output(True)
    return g


def matmul_group(g):
    (group,) = [x for x in partition(g, registry.families()) if x.kind == "matmul"]
    return group, problem_of(g, group)


def lowered(g, config: GluonConfig = None, target=H100):
    """The gluon launches of `g`'s matmul group for `target`, lowered directly (this machine's
    builds are interpreted, where gluon does not take part)."""
    group, problem = matmul_group(g)
    options = dg.BuildOptions(backends=("gluon", "triton"), target=target)
    context = BuildContext(torch.device("cuda"), target, options)
    candidate = None if config is None else Candidate("gluon", config, None)
    return GLUON.lower(g, group, problem, context, candidate)


def kmajor_variants():
    """(type, epilogue, batch) of the K-major cases: 16-bit and fp8 e4m3 (scaled) over
    KMAJOR_EPILOGUES, plain and batched; B shared by every batch and e5m2 with one epilogue."""
    for type_name in ("bf16", "fp16", "e4m3"):
        for epilogue in KMAJOR_EPILOGUES:
            for batch in ("plain", "batched"):
                yield type_name, epilogue, batch
    yield "bf16", "bias", "batched_b_shared"
    yield "e4m3", "bias", "batched_b_shared"
    yield "e5m2", "none", "plain"


def _cases_of(g, prefix: str):
    group, problem = matmul_group(g)
    dtypes = {t.uid: t.data_type.torch_dtype for t in g.tensors}
    for candidate in GLUON.candidates(problem, H100):
        config = candidate.config
        launches = lowered(g, config)
        label = (f"{prefix}/{config.block_n}x{config.stages}x{config.consumers}"
                 f"/{'tma' if config.tma_store else 'ptr'}")
        yield label, launches, dtypes


def compile_cases():
    """(label, launches, dtypes) of every config x epilogue x batch case, then of every config of
    the K-major variants (labels "kmajor/...")."""
    for type_name, epilogue, batch in compile_variants():
        yield from _cases_of(graph(type_name, epilogue, batch), f"{type_name}/{epilogue}/{batch}")
    yield from kmajor_cases()


def compile_variants():
    """(type, epilogue, batch) of the row-major B compile cases: every epilogue x batch form (each
    compiled at every config _cases_of offers), the 16-bit type alternating over them. What a
    config x epilogue x batch form does to a kernel (its registers, spills, tiles, descriptors)
    is compiled whole; bf16 and fp16 differ only in the element type of the same wgmma and
    conversions, so each type meets every config, every epilogue and every batch form (all
    pairs) without compiling the product twice (half the kernels)."""
    types = sorted(TYPES)
    for epilogue_index, epilogue in enumerate(EPILOGUES):
        for batch_index, batch in enumerate(BATCHES):
            yield types[(epilogue_index + batch_index) % len(types)], epilogue, batch


def kmajor_cases():
    """The K-major B cases (16-bit; fp8 with scales, K = 96: fp8 rows a multiple of 16 bytes)."""
    for type_name, epilogue, batch in kmajor_variants():
        k = 96 if type_name in FP8_TYPES else 72
        yield from _cases_of(graph(type_name, epilogue, batch, k=k, k_major=True),
                             f"kmajor/{type_name}/{epilogue}/{batch}")


def _config_label(config) -> str:
    return f"{config.block_m}x{config.block_n}x{config.stages}x{config.consumers}/e{config.epilogue_n}"


# the ping-pong compile cases: (type, epilogue, batch, k_major)
PINGPONG_VARIANTS = tuple((type_name, epilogue, batch, False) for type_name in ("bf16", )
                          for epilogue in ("none", "bias", "bias_row_gelu", "residual_silu")
                          for batch in ("plain", "batched")) + (("bf16", "relu_cast", "plain", False),
                                                                  ("e4m3", "scale_gelu_tanh", "batched", True))


def pingpong_cases():
    """(label, launches, dtypes) of every ping-pong config (PINGPONG_CONFIGS, given from outside:
    candidates() does not offer them yet) over PINGPONG_VARIANTS; labels "pingpong/...". The fp8
    one with K = 96 (fp8 rows a multiple of 16 bytes)."""
    for type_name, epilogue, batch, k_major in PINGPONG_VARIANTS:
        g = graph(type_name, epilogue, batch, k=96 if type_name in FP8_TYPES else 72, k_major=k_major)
        dtypes = {t.uid: t.data_type.torch_dtype for t in g.tensors}
        for config in PINGPONG_CONFIGS:
            launches = lowered(g, config)
            store = "tma" if "tma-store" in launches[0].config_text else "ptr"
            label = f"pingpong/{'kmajor/' if k_major else ''}{type_name}/{epilogue}/{batch}/{_config_label(config)}/{store}"
            yield label, launches, dtypes


def quick_cases():
    """A few cases for a short compile run."""
    for label, launches, dtypes in compile_cases():
        if "/none/" in label or "residual" in label:
            yield label, launches, dtypes


# -- the epilogue's code size (issue 28): bias with each activation, at the GEMM's big tiles ------

def _bias_act(activation):
    def build(g, c, dims, t):
        biased = g.add(c, g.tensor(name="bias", dim=[dims[-1]], data_type=t))
        return getattr(g, activation)(biased) if activation else biased
    return build


CODE_SIZE_EPILOGUES = {"bias": _bias_act(None), "bias_relu": _bias_act("relu"),
                       "bias_gelu_tanh": _bias_act("gelu_tanh"), "bias_gelu": _bias_act("gelu")}
CODE_SIZE_CONFIGS = {"128x256s4": GluonConfig(128, 256, 64, 4, 2), "128x128s6": GluonConfig(128, 128, 64, 6, 2)}


def code_size_cases(loops=(False, True), epilogues=tuple(CODE_SIZE_EPILOGUES), configs=None):
    """(label, launches, dtypes) of bf16 4096^3 matmuls with CODE_SIZE_EPILOGUES (bf16 output: the
    16-bit GELU) under CODE_SIZE_CONFIGS, the heavy-epilogue filter lifted, the epilogue's
    subtiles unrolled and in a loop (GluonConfig.epilogue_loop); labels
    "code/EPILOGUE/CONFIG/e{EPILOGUE_N}/{unrolled|loop}". Compile with SM90_SASS=1 for the SASS size."""
    import dnngraph.backends.gluon.backend as gluon_backend
    configs = configs or CODE_SIZE_CONFIGS
    saved = gluon_backend.HEAVY_EPILOGUE_ACCUMULATORS, gluon_backend.CONFIGS
    gluon_backend.HEAVY_EPILOGUE_ACCUMULATORS = 1 << 20
    gluon_backend.CONFIGS = gluon_backend.CONFIGS + tuple(configs.values())  # taken from outside
    try:
        for epilogue in epilogues:
            build = CODE_SIZE_EPILOGUES[epilogue]
            g = dg.Graph(name="code_size", io_data_type=dg.bfloat16)
            a = g.tensor(name="a", dim=[4096, 4096])
            b = g.tensor(name="b", dim=[4096, 4096])
            build(g, g.matmul(a, b), [4096, 4096], dg.bfloat16).set_output(True)
            dtypes = {t.uid: t.data_type.torch_dtype for t in g.tensors}
            for name, config in configs.items():
                for loop in loops:
                    forced = dataclasses.replace(config, epilogue_loop=loop)
                    label = f"code/{epilogue}/{name}/e{config.epilogue_n}/{'loop' if loop else 'unrolled'}"
                    yield label, lowered(g, forced), dtypes
    finally:
        gluon_backend.HEAVY_EPILOGUE_ACCUMULATORS, gluon_backend.CONFIGS = saved


def code_size_test_cases():
    """code_size_cases of bias alone (the kernel's own MUFU instructions) and the two GELUs; and a
    GELU asking for a loop over 128-column subtiles at 128x256, past the looped epilogue's
    registers (backend.LOOPED_EPILOGUE_REGISTERS: it would spill), so lowered unrolled."""
    yield from code_size_cases(epilogues=("bias", "bias_gelu_tanh", "bias_gelu"))
    wide = {"128x256s4": GluonConfig(128, 256, 64, 4, 2, epilogue_n=128)}
    yield from code_size_cases(loops=(True, ), epilogues=("bias_gelu_tanh", ), configs=wide)
