"""Render the Gluon attention forward kernel of one sdpa group: its signature and the call of
attention_library.attention (the fixed kernel).

Identifiers come from the kernel's NameAllocator (user tensor and node names never reach the
source; the description in its docstring passes through comment_text).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import UnsupportedError
from ..contract import KernelSource
from ..triton.codegen.names import NameAllocator, comment_text
from ..triton.codegen.pointwise import KernelArgument

STEMS = ("q", "k", "v", "o", "stats")
AXES = ("batch", "head", "row")
# the names every kernel writes literally (its parameters and the module's)
CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "HEAD_DIM", "STAGES", "CAUSAL", "STATS", "QK_SCALE", "PRODUCER_REGS",
              "CONSUMER_REGS", "PINGPONG", "WINDOW")
SIZES = ("s_q", "s_kv", "heads", "group", "shift", "window_shift")
FIXED = (("gl", "gluon", "alib") + tuple(f"{stem}_ptr" for stem in STEMS) +
         tuple(f"{stem}_stride_{axis}" for stem in STEMS for axis in AXES) + SIZES + CONSTEXPRS)


@dataclass(frozen=True)
class AttentionArguments:
    """The kernel's tensors (uids; stats None where the group does not store them), sizes and
    strides in elements ((batch, head, row) of each tensor, the last axis contiguous)."""

    uids: dict  # stem -> uid
    strides: dict  # stem -> (batch, head, row)
    s_q: int
    s_kv: int
    heads: int
    group: int  # query heads per key/value head
    shift: int  # key j visible to query i (a right bound, CAUSAL) when j <= i + shift
    window_shift: int = 0  # and (a left bound, WINDOW) when j >= i + window_shift


def signature(names: NameAllocator, attention: AttentionArguments, constexprs: dict) -> tuple:
    """(def-line parameter text, [KernelArgument]) of the kernel, in one order: the tensors,
    their strides, the sizes, then the constexprs."""
    present = [stem for stem in STEMS if attention.uids.get(stem) is not None]
    arguments = [KernelArgument("tensor", f"{stem}_ptr", attention.uids[stem]) for stem in present]
    for stem in present:
        for axis, value in zip(AXES, attention.strides[stem]):
            arguments.append(KernelArgument("int", f"{stem}_stride_{axis}", int(value)))
    arguments += [KernelArgument("int", name, int(getattr(attention, name))) for name in SIZES]
    arguments += [KernelArgument("constexpr", name, constexprs[name]) for name in CONSTEXPRS]
    for argument in arguments:
        if not names.owns(argument.name):
            raise UnsupportedError(f"internal error: kernel parameter {argument.name!r} has no allocated name")
    text = ", ".join(a.name + (": gl.constexpr" if a.kind == "constexpr" else "") for a in arguments)
    return text, arguments


def _strides(stem: str, present: bool) -> str:
    if not present:
        return "(0, 0, 0)"
    return "(" + ", ".join(f"{stem}_stride_{axis}" for axis in AXES) + ")"


def render(stem: str, description: str, attention: AttentionArguments, constexprs: dict) -> KernelSource:
    """The source of one sdpa group's attention kernel, defined as `stem` (load_kernel names it)."""
    names = NameAllocator(FIXED)
    names.reserve(stem)
    parameters, arguments = signature(names, attention, constexprs)
    stats = attention.uids.get("stats") is not None
    if constexprs["STATS"] != stats:
        raise UnsupportedError("internal error: STATS disagrees with the stats tensor")
    strides = ", ".join(_strides(s, attention.uids.get(s) is not None) for s in STEMS)
    text = f'''"""{comment_text(description)}"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dnngraph.backends.gluon import attention_library as alib


@gluon.jit
def {stem}({parameters}):
    alib.attention(q_ptr, k_ptr, v_ptr, o_ptr, {"stats_ptr" if stats else "0"}, {strides},
                   s_q, s_kv, heads, group, shift, window_shift, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, WINDOW,
                   STATS, QK_SCALE, PRODUCER_REGS, CONSUMER_REGS, PINGPONG)
'''
    return KernelSource(stem, text, list(arguments))

