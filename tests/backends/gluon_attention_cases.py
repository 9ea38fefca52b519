"""sdpa groups the Gluon backend's attention kernel lowers, for the sm_90a compile test
(tests/sm90_compile.py) and the GPU tests of test_gluon_attention.py: every type x head dim x
mask x head grouping x stats variant."""
from __future__ import annotations

import torch

import dnngraph as dg
from dnngraph.backends import registry
from dnngraph.backends.contract import BuildContext, Candidate
from dnngraph.backends.gluon.attention_backend import CONFIGS
from dnngraph.backends.gluon.backend import GLUON
from dnngraph.fusion import partition
from dnngraph.problems import problem_of
from dnngraph.target import H100

TYPES = {"bf16": dg.bfloat16, "fp16": dg.float16}
HEAD_DIMS = (64, 128)
MASKS = ("none", "causal", "causal_bottom_right")
# diagonal band bounds: name -> (left bound, right bound, bottom right); "window" is a causal
# sliding window, "band" bounds both sides, "left_only" bounds the left alone
BANDS = {"window": (64, 0, False), "band_bottom_right": (100, 20, True), "left_only": (150, None, False)}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1), "single": (1, 1)}  # (H, H_kv)


def graph(type_name: str, head_dim: int, mask: str, heads: str, stats: bool = False, batch: int = 2,
          s_q: int = 200, s_kv: int = 200, attn_scale=None):
    """o (and, training form, the stats) of sdpa(q, k, v) over [B, H, S, D] tensors."""
    t = TYPES[type_name]
    h, h_kv = HEADS[heads]
    g = dg.Graph(name="gluon_attention_case", io_data_type=t)
    q = g.tensor(name="q", dim=[batch, h, s_q, head_dim], data_type=t)
    k = g.tensor(name="k", dim=[batch, h_kv, s_kv, head_dim], data_type=t)
    v = g.tensor(name="v", dim=[batch, h_kv, s_kv, head_dim], data_type=t)
    o, lse = g.sdpa(q, k, v, attn_scale=attn_scale, is_inference=not stats, **mask_arguments(mask), name="attn")
    o.set_output(True)
    if stats:
        lse.set_output(True)
    return g


def mask_arguments(mask: str) -> dict:
    """sdpa's keyword arguments of a mask of MASKS or BANDS."""
    if mask in BANDS:
        left, right, bottom_right = BANDS[mask]
        return dict(diagonal_alignment="bottom_right" if bottom_right else "top_left",
                    diagonal_band_left_bound=left, diagonal_band_right_bound=right)
    return dict(use_causal_mask=mask == "causal", use_causal_mask_bottom_right=mask == "causal_bottom_right")


def sdpa_group(g):
    (group,) = [x for x in partition(g, registry.families()) if x.kind == "sdpa"]
    return group, problem_of(g, group)


def lowered(g, target=H100, config=None):
    """The gluon launches of `g`'s sdpa group for `target` (of `config`, an AttentionConfig,
    where given), lowered directly (this machine's builds are interpreted, where gluon does not
    take part)."""
    group, problem = sdpa_group(g)
    options = dg.BuildOptions(backends=("gluon", "triton"), target=target)
    context = BuildContext(torch.device("cuda"), target, options)
    candidate = None if config is None else Candidate("gluon", config, None)
    return GLUON.lower(g, group, problem, context, candidate)


def variants():
    """(type, head dim, mask, heads, stats) of every compiled case: every head dim x mask x head
    grouping (stats with gqa), the 16-bit type alternating over them. What those do to a kernel
    (tiles, registers, the mask's loop bounds, the kv head's index) is compiled whole; bf16 and
    fp16 differ only in the element type of the same wgmma and conversions, so each type meets
    every head dim, mask and grouping (all pairs) without compiling the product twice."""
    types = sorted(TYPES)
    for dim_index, head_dim in enumerate(HEAD_DIMS):
        for mask_index, mask in enumerate(MASKS):
            for heads_index, heads in enumerate(("mha", "gqa", "mqa")):
                type_name = types[(dim_index + mask_index + heads_index) % len(types)]
                yield type_name, head_dim, mask, heads, heads == "gqa"


# sizes of one (the launcher passes an integer 1 as a constant): one query, one or many keys
EDGES = {"one": dict(batch=1, s_q=1, s_kv=1), "one_query": dict(batch=1, s_q=1, s_kv=1000)}


# the band variants compiled: each band, head dim and type met once, beside the variants above
# (the bounds add two runtime shifts and a compare to the same masked block, and a start block)
BAND_VARIANTS = (("bf16", 64, "window", "gqa", True), ("fp16", 128, "band_bottom_right", "mha", False),
                 ("bf16", 128, "left_only", "mqa", True))


def band_cases():
    """(label, launches, dtypes) of the band variants, and the ping-pong schedule under one."""
    for type_name, head_dim, mask, heads, stats in BAND_VARIANTS:
        g = graph(type_name, head_dim, mask, heads, stats)
        dtypes = {t.uid: t.data_type.torch_dtype for t in g.tensors}
        yield f"{type_name}/d{head_dim}/{mask}/{heads}{'/stats' if stats else ''}", lowered(g), dtypes
    g = graph("fp16", 64, "band_bottom_right", "gqa", True)
    pingpong = next(c for c in CONFIGS[64] if c.pingpong)
    yield "pingpong/d64/band_bottom_right", lowered(g, config=pingpong), {t.uid: t.data_type.torch_dtype
                                                                         for t in g.tensors}


def compile_cases():
    """(label, launches, dtypes) of every variant."""
    for type_name, head_dim, mask, heads, stats in variants():
        g = graph(type_name, head_dim, mask, heads, stats)
        dtypes = {t.uid: t.data_type.torch_dtype for t in g.tensors}
        label = f"{type_name}/d{head_dim}/{mask}/{heads}{'/stats' if stats else ''}"
        yield label, lowered(g), dtypes
    for edge, sizes in EDGES.items():
        for mask in MASKS:
            g = graph("bf16", 128, mask, "single", True, **sizes)
            dtypes = {t.uid: t.data_type.torch_dtype for t in g.tensors}
            yield f"edge/{edge}/{mask}", lowered(g), dtypes
    for head_dim in HEAD_DIMS:  # the ping-pong schedule: each mask, with the stats
        pingpong = next(c for c in CONFIGS[head_dim] if c.pingpong)
        for mask in MASKS:
            g = graph("bf16", head_dim, mask, "gqa", True)
            dtypes = {t.uid: t.data_type.torch_dtype for t in g.tensors}
            yield f"pingpong/d{head_dim}/{mask}", lowered(g, config=pingpong), dtypes
    yield from band_cases()


def quick_cases():
    """A few cases for a short compile run."""
    for label, launches, dtypes in compile_cases():
        if "/mha" in label or "/stats" in label:
            yield label, launches, dtypes
