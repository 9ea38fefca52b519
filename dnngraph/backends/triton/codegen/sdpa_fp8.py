"""Render the kernels of an sdpa_fp8 or sdpa_fp8_backward group: each is one call of the fixed
code in sdpa_fp8_library (`fp8a`) with the group's tensors, their strides, the sizes and the
constexprs (tiles, the mask, the fp8 conversion rules as literals).

Parameter names are fixed roles (q, k, descale_q, ...): no user name reaches the source but the
sanitized docstring.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .conversions import float8_rule
from ...contract import KernelSource
from .pointwise import KernelArgument, kernel_module

# role -> rank of its strides (stats [B, H, Sq, 1]: three); scales and amaxes are read or written
# through their pointer alone
STRIDED = {"q": 4, "k": 4, "v": 4, "o": 4, "do": 4, "stats": 3, "dq": 4, "dk": 4, "dv": 4,
           "v_t": 4, "k_t": 4, "q_t": 4, "do_t": 4}
# the keys-minor copies ([B, H, D, S padded]) each kernel reads, made first by keys_minor_copy
KEYS_MINOR = {"forward": ("v",), "dkdv": ("q", "do"), "dq": ("k",)}
# the library function of each kernel and the roles it takes, in its parameter order
KERNELS = {
    "forward": ("forward", ("q", "k", "v_t", "o", "stats", "descale_q", "descale_k", "descale_v", "descale_s",
                            "scale_s", "scale_o", "amax_s", "amax_o")),
    "dkdv": ("backward_dkdv", ("q", "k", "v", "delta", "do", "stats", "q_t", "do_t", "dk", "dv", "descale_q",
                               "descale_k", "descale_v", "descale_do", "descale_s", "descale_dp", "scale_s",
                               "scale_dk", "scale_dv", "scale_dp", "amax_dk", "amax_dv")),
    "dq": ("backward_dq", ("q", "k", "v", "delta", "do", "stats", "k_t", "dq", "descale_q", "descale_k",
                           "descale_v", "descale_do", "descale_dp", "scale_dq", "scale_dp", "amax_dq", "amax_dp")),
}


@dataclass(frozen=True)
class Fp8AttentionSpec:
    """Plain data a kernel renders from: tensors by role, sizes, the score scale, the mask and
    tiles (BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV). `tensors` holds the keys-minor copies too
    (roles v_t, k_t, q_t, do_t) and, for the backward, row_deltas' buffer (delta)."""

    tensors: dict  # role -> graph Tensor
    heads: int
    group: int  # query heads per k/v head
    s_q: int
    s_kv: int
    head_dim: int
    value_dim: int
    scale: float
    causal: bool
    block: tuple


def rule_literal(data_type) -> tuple:
    """The (first overflow, overflow, infinity, NaN encodings, saturates) tuple of an fp8 type, or
    a stand-in for another type (never read: its IS_FP8 flag is False). `saturates`: torch
    encodes overflow and infinity as the type's largest finite value, as the GPU's satfinite
    conversion does (e4m3fn in recent torch), so a dot operand needs no correction but NaN's sign."""
    if data_type.itemsize != 1:
        return (0.0, 0, 0, 0, False)
    rule = float8_rule(data_type)
    largest = torch.tensor([torch.finfo(data_type.torch_dtype).max]).to(data_type.torch_dtype).view(torch.uint8)
    saturates = rule.overflow_bits == rule.infinity_bits == int(largest.item())
    return (rule.first_overflow, rule.overflow_bits, rule.infinity_bits, rule.nan_bits, saturates)


def _stored_flags(spec: Fp8AttentionSpec, which: str) -> dict:
    """The fp8 flag and conversion rule of each output a kernel stores, P's (q's type) and the
    backward's dS's (dO's type)."""
    flags = {"P_RULE": rule_literal(spec.tensors["q"].data_type)}
    if which != "forward":
        flags["DS_RULE"] = rule_literal(spec.tensors["do"].data_type)
    outputs = {"forward": ("o",), "dkdv": ("dk", "dv"), "dq": ("dq",)}[which]
    for role in outputs:
        data_type = spec.tensors[role].data_type
        flags[f"{role.upper()}_FP8"] = data_type.itemsize == 1
        flags[f"{role.upper()}_RULE"] = rule_literal(data_type)
    return flags


def render(kernel_name: str, which: str, spec: Fp8AttentionSpec, description: str) -> KernelSource:
    """The KernelSource of kernel `which` ("forward", "dkdv", "dq") under `spec`."""
    function, roles = KERNELS[which]
    args, call = [], []
    for role in roles:  # a forward without stats passes o as a stand-in (HAS_STATS False)
        tensor = spec.tensors.get(role) or spec.tensors["o"]
        args.append(KernelArgument("tensor", f"{role}_ptr", tensor.uid))
        call.append(f"{role}_ptr")
    for role in roles:
        if role not in STRIDED:
            continue
        tensor = spec.tensors.get(role)
        strides = tuple(tensor.stride[:STRIDED[role]]) if tensor is not None else (0,) * STRIDED[role]
        for axis, stride in enumerate(strides):
            args.append(KernelArgument("int", f"{role}_s{axis}", int(stride)))
            call.append(f"{role}_s{axis}")
    for name, value in (("HEADS", spec.heads), ("GROUP", spec.group), ("SQ", spec.s_q), ("SKV", spec.s_kv)):
        args.append(KernelArgument("int", name, value))
        call.append(name)
    constexprs = {"SCALE": spec.scale, "CAUSAL": spec.causal, "HEAD_DIM": spec.head_dim, "VALUE_DIM": spec.value_dim}
    if which == "forward":
        constexprs["HAS_STATS"] = spec.tensors.get("stats") is not None
    constexprs.update(_stored_flags(spec, which))
    constexprs.update(zip(("BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV"), spec.block))
    call += [f"{name}={value!r}" for name, value in constexprs.items()]
    body = f"    fp8a.{function}(\n" + "".join(f"        {item},\n" for item in call) + "    )\n"
    return KernelSource(kernel_name, kernel_module(description, [], kernel_name, args, body, libraries=("fp8a",)),
                        tuple(args))


def render_zero(kernel_name: str, amax_uids: list, description: str) -> KernelSource:
    """The kernel zeroing a group's amax outputs (two or four) before its kernels max into them."""
    padded = list(amax_uids) + list(amax_uids[:2]) * (len(amax_uids) == 2)
    names = ("first_ptr", "second_ptr", "third_ptr", "fourth_ptr")
    args = [KernelArgument("tensor", name, uid) for name, uid in zip(names, padded)]
    body = f"    fp8a.zero_amax({', '.join(names)}, COUNT={len(amax_uids)})\n"
    return KernelSource(kernel_name, kernel_module(description, [], kernel_name, args, body, libraries=("fp8a",)),
                        tuple(args))


def render_keys_minor(kernel_name: str, source, copy, block: tuple, description: str) -> KernelSource:
    """The kernel copying `source` ([B, H, S, D], a graph tensor) to `copy` (a contiguous
    [B, H, D, S padded] buffer) with keys_minor_copy on tiles `block` (BLOCK_R, BLOCK_W)."""
    args = [KernelArgument("tensor", "src_ptr", source.uid), KernelArgument("tensor", "dst_ptr", copy.uid)]
    args += [KernelArgument("int", f"src_s{axis}", int(stride)) for axis, stride in enumerate(source.stride[:4])]
    args += [KernelArgument("int", name, int(value))
             for name, value in (("HEADS", source.dim[1]), ("ROWS", source.dim[2]), ("ROWS_PAD", copy.dim[3]))]
    constexprs = {"WIDTH": int(source.dim[3]), "BLOCK_R": block[0], "BLOCK_W": block[1]}
    call = [a.name for a in args] + [f"{name}={value!r}" for name, value in constexprs.items()]
    body = "    fp8a.keys_minor_copy(" + ", ".join(call) + ")\n"
    return KernelSource(kernel_name, kernel_module(description, [], kernel_name, args, body, libraries=("fp8a",)),
                        tuple(args))


def render_row_deltas(kernel_name: str, tensors: dict, value_dim: int, block: tuple, description: str) -> KernelSource:
    """The kernel taking delta = rowsum(o dO) of a backward group into its buffer (role delta of
    `tensors`, [B, H, Sq] float32) on tiles `block` (BLOCK_M, BLOCK_DV)."""
    roles = ("o", "do", "delta", "descale_o", "descale_do")
    args = [KernelArgument("tensor", f"{role}_ptr", tensors[role].uid) for role in roles]
    args += [KernelArgument("int", f"{role}_s{axis}", int(stride))
             for role in ("o", "do") for axis, stride in enumerate(tensors[role].stride[:4])]
    _, heads, s_q = tensors["delta"].dim
    args += [KernelArgument("int", "HEADS", heads), KernelArgument("int", "SQ", s_q)]
    constexprs = {"VALUE_DIM": value_dim, "BLOCK_M": block[0], "BLOCK_DV": block[1]}
    call = [a.name for a in args] + [f"{name}={value!r}" for name, value in constexprs.items()]
    body = "    fp8a.row_deltas(" + ", ".join(call) + ")\n"
    return KernelSource(kernel_name, kernel_module(description, [], kernel_name, args, body, libraries=("fp8a",)),
                        tuple(args))
