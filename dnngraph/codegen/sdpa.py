"""The flash-attention forward kernel of an sdpa group, rendered from an AttentionSpec.

One program: BLOCK_M queries of one (batch, head). It walks the key blocks its mask lets it see
in three runs: masked blocks before the fully visible ones (a left bound), the fully visible
blocks with no mask arithmetic at all, and masked blocks after them (the diagonal of a causal
mask, the last partial block, a right bound). Per block:

    s = (q k^T) * scale * log2(e)  [+ bias * log2(e)]      scores in base 2
    m_new = max(m, rowmax(s)); p = exp2(s - m_new); alpha = exp2(m - m_new)
    l = l * alpha + rowsum(p);  acc = acc * alpha + p v     (p dropped out after l counts it)

1/l is applied once in the epilogue; a row that sees no key keeps m = -inf and l = 0 and is
written as zeros (its stats -inf). Every identifier is fixed here or drawn from the kernel's
NameAllocator; user names reach comments only. The epilogue (pointwise consumers of o) goes
through the shared ExpressionEmitter at the output position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..ops.dropout import keep_threshold
from .emitter import ExpressionEmitter, kind_of
from .names import NameAllocator
from .pointwise import KernelArgument, header

LOG2E = 1.4426950408889634

# Identifiers the template writes literally.
FIXED = ("pid_m", "pid_bh", "batch", "head", "kv_head", "rows", "cols_d", "cols_dv", "row_in",
         "len_q", "len_kv", "shift", "lo", "hi", "full_lo", "full_hi", "q_tile", "m_i", "l_i", "acc",
         "start_n", "keys", "key_in", "k_rows", "v_rows", "k_tile", "v_tile", "scores", "visible",
         "m_new", "m_use", "p_tile", "alpha", "l_use", "out", "lse", "bias_tile", "page",
         "k_base", "v_base", "q_base", "keep", "counter", "qk_scale", "run_a", "run_b", "o_mask",
         "q_ptr", "k_ptr", "v_ptr", "o_ptr", "stats_ptr", "bias_ptr", "lenq_ptr", "lenkv_ptr",
         "ktab_ptr", "vtab_ptr", "HEADS", "GROUP", "SQ", "SKV", "HEAD_DIM", "VALUE_DIM", "BLOCK_M",
         "BLOCK_N", "BLOCK_D", "BLOCK_DV", "PAGE", "seed", "offset")
STRIDE_STEMS = ("q", "k", "v", "o", "stats", "bias", "lenq", "lenkv", "ktab", "vtab")
STRIDE_NAMES = tuple(f"{stem}_s{axis}" for stem in STRIDE_STEMS for axis in range(4))


@dataclass(frozen=True)
class AttentionSpec:
    """Plain data the renderer needs: what is present, the mask, the sizes and strides."""

    dims: dict  # HEADS, GROUP, SQ, SKV, HEAD_DIM, VALUE_DIM (ints)
    strides: dict  # stem -> tuple of per-axis strides (q/k/v/o/bias [4], stats [3], lens/tables [B, P])
    uids: dict  # stem -> tensor uid (present operands only)
    scale: float
    left: Optional[int]
    right: Optional[int]
    bottom_right: bool
    dropout: Optional[tuple]  # (p, seed, offset)
    page_size: Optional[int]  # paged K/V
    block: tuple  # BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV
    wide_index: bool  # some operand offset may pass 2^31: row offsets in int64
    precision: str  # tl.dot input_precision for fp32 operands ("ieee", "tf32"), "" for 16-bit


def _mask_argument(terms: list) -> str:
    """`, mask=..., other=0.0` of a load, or nothing when no term masks it."""
    return f", mask={' & '.join(terms)}, other=0.0" if terms else ""


class _Writer:
    def __init__(self, spec: AttentionSpec, compute_type: str):
        self.spec, self.body = spec, []
        self.names = NameAllocator(FIXED + STRIDE_NAMES)
        self.dot_options = f", input_precision=\"{spec.precision}\"" if spec.precision else ""
        self.emitter = ExpressionEmitter(compute_type, names=self.names, hint="e")

    def line(self, text: str, depth: int = 1):
        self.body.append("    " * depth + text)

    def has(self, stem: str) -> bool:
        return stem in self.spec.uids

    def d_mask(self, axes: str) -> list:
        """The head-dim mask term of a load, none where BLOCK_D is the head dim."""
        return [] if self.spec.block[2] == self.spec.dims["HEAD_DIM"] else [f"(cols_d{axes} < HEAD_DIM)"]

    def dv_mask(self, axes: str) -> list:
        return [] if self.spec.block[3] == self.spec.dims["VALUE_DIM"] else [f"(cols_dv{axes} < VALUE_DIM)"]

    def stride(self, stem: str, axis: int) -> str:
        return f"{stem}_s{axis}"

    # --- program and query tile ---------------------------------------------------------------
    def prologue(self):
        w, wide = self.line, self.spec.wide_index
        w("pid_m = tl.program_id(0)")
        w("pid_bh = tl.program_id(1)")
        w("batch = pid_bh // HEADS")
        w("head = pid_bh % HEADS")
        w("kv_head = head // GROUP")
        w("rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        w("cols_d = tl.arange(0, BLOCK_D)")
        w("cols_dv = tl.arange(0, BLOCK_DV)")
        w("row_in = rows < SQ")
        w("len_q = " + (f"tl.load(lenq_ptr + batch * {self.stride('lenq', 0)}).to(tl.int32)"
                        if self.has("lenq") else "SQ"))
        w("len_kv = " + (f"tl.load(lenkv_ptr + batch * {self.stride('lenkv', 0)}).to(tl.int32)"
                         if self.has("lenkv") else "SKV"))
        w("len_kv = tl.minimum(len_kv, SKV)")
        w("shift = " + ("len_kv - len_q" if self.spec.bottom_right else "0"))
        cast = ".to(tl.int64)" if wide else ""
        w(f"q_base = batch{cast} * {self.stride('q', 0)} + head{cast} * {self.stride('q', 1)}")
        w(f"q_tile = tl.load(q_ptr + q_base + rows[:, None]{cast} * {self.stride('q', 2)} + "
          f"cols_d[None, :] * {self.stride('q', 3)}{_mask_argument(['row_in[:, None]'] + self.d_mask('[None, :]'))})")
        if not self.spec.page_size:
            w(f"k_base = batch{cast} * {self.stride('k', 0)} + kv_head{cast} * {self.stride('k', 1)}")
            w(f"v_base = batch{cast} * {self.stride('v', 0)} + kv_head{cast} * {self.stride('v', 1)}")
        w("m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)")
        w("l_i = tl.zeros([BLOCK_M], tl.float32)")
        w("acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)")
        w(f"qk_scale = {self.spec.scale * LOG2E!r}")

    def key_range(self):
        """lo/hi bound the blocks any row sees; [full_lo, full_hi) those every row sees whole."""
        w, spec = self.line, self.spec
        w("lo = 0")
        w("hi = len_kv")
        w("full_lo = 0")
        w("full_hi = len_kv")
        if spec.right is not None:
            w(f"hi = tl.minimum(hi, pid_m * BLOCK_M + BLOCK_M + shift + {spec.right})")
            w(f"full_hi = tl.minimum(full_hi, pid_m * BLOCK_M + shift + {spec.right} + 1)")
        if spec.left is not None:
            w(f"lo = tl.maximum(lo, pid_m * BLOCK_M + shift - {spec.left} + 1)")
            w(f"full_lo = tl.maximum(lo, pid_m * BLOCK_M + BLOCK_M - 1 + shift - {spec.left} + 1)")
        w("hi = tl.maximum(hi, 0)")
        w("lo = tl.minimum(lo, hi) // BLOCK_N * BLOCK_N")
        # the fully visible run starts and ends on block edges inside [lo, hi]
        w("run_a = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), hi)")
        w("run_b = tl.maximum(tl.minimum(full_hi // BLOCK_N * BLOCK_N, hi), run_a)")

    # --- one key block ------------------------------------------------------------------------
    def key_rows(self, stem: str, depth: int) -> str:
        """Offsets of the block's key rows in k or v (a page gather when paged)."""
        w, wide = self.line, self.spec.wide_index
        if not self.spec.page_size:
            keys = "keys.to(tl.int64)" if wide else "keys"
            w(f"{stem}_rows = {stem}_base + {keys} * {self.stride(stem, 2)}", depth)
            return f"{stem}_rows"
        table = "ktab" if stem == "k" else "vtab"
        w(f"page = tl.load({table}_ptr + batch * {self.stride(table, 0)} + (keys // PAGE) * "
          f"{self.stride(table, 2)}, mask=key_in, other=0).to(tl.int64)", depth)
        w(f"{stem}_rows = page * {self.stride(stem, 0)} + kv_head.to(tl.int64) * {self.stride(stem, 1)} + "
          f"(keys % PAGE) * {self.stride(stem, 2)}", depth)
        return f"{stem}_rows"

    def block(self, masked: bool, depth: int):
        w, spec = self.line, self.spec
        w("keys = start_n + tl.arange(0, BLOCK_N)", depth)
        w("key_in = keys < len_kv", depth)
        k_rows = self.key_rows("k", depth)
        terms = (["key_in[None, :]"] if masked else []) + self.d_mask("[:, None]")
        w(f"k_tile = tl.load(k_ptr + {k_rows}[None, :] + cols_d[:, None] * {self.stride('k', 3)}"
          f"{_mask_argument(terms)})", depth)
        w(f"scores = tl.dot(q_tile, k_tile{self.dot_options}) * qk_scale", depth)
        if self.has("bias"):
            cast = ".to(tl.int64)" if spec.wide_index else ""
            w(f"bias_tile = tl.load(bias_ptr + batch{cast} * {self.stride('bias', 0)} + head{cast} * "
              f"{self.stride('bias', 1)} + rows[:, None] * {self.stride('bias', 2)} + keys[None, :] * "
              f"{self.stride('bias', 3)}, mask=row_in[:, None] & key_in[None, :], other=0.0)", depth)
            w(f"scores += bias_tile.to(tl.float32) * {LOG2E!r}", depth)
        if masked:
            w("visible = key_in[None, :] & (rows[:, None] >= 0)", depth)
            if spec.right is not None:
                w(f"visible = visible & (keys[None, :] - (rows[:, None] + shift) <= {spec.right})", depth)
            if spec.left is not None:
                w(f"visible = visible & ((rows[:, None] + shift) - keys[None, :] < {spec.left})", depth)
            w("scores = tl.where(visible, scores, float('-inf'))", depth)
        w("m_new = tl.maximum(m_i, tl.max(scores, 1))", depth)
        # rows that have seen no key yet keep m = -inf: subtract 0 there (exp2(-inf) = 0, no NaN)
        w("m_use = tl.where(m_new == float('-inf'), 0.0, m_new)", depth)
        w("p_tile = tl.math.exp2(scores - m_use[:, None])", depth)
        w("alpha = tl.math.exp2(m_i - m_use)", depth)
        w("l_i = l_i * alpha + tl.sum(p_tile, 1)", depth)
        if spec.dropout is not None:
            p = spec.dropout[0]
            w("counter = ((pid_bh.to(tl.int64) * SQ + rows[:, None]) * SKV + keys[None, :])", depth)
            w(f"p_tile, keep = tm.dropout(p_tile, seed, offset, counter, {keep_threshold(p)}, "
              f"{1.0 / (1.0 - p)!r})", depth)
        v_rows = self.key_rows("v", depth)
        terms = (["key_in[:, None]"] if masked else []) + self.dv_mask("[None, :]")
        w(f"v_tile = tl.load(v_ptr + {v_rows}[:, None] + cols_dv[None, :] * {self.stride('v', 3)}"
          f"{_mask_argument(terms)})", depth)
        w(f"acc = acc * alpha[:, None] + tl.dot(p_tile.to(v_tile.dtype), v_tile{self.dot_options})", depth)
        w("m_i = m_new", depth)

    def loops(self):
        for first, last, masked in (("lo", "run_a", True), ("run_a", "run_b", False), ("run_b", "hi", True)):
            self.line(f"for start_n in range({first}, {last}, BLOCK_N):")
            self.block(masked, 2)

    # --- epilogue -----------------------------------------------------------------------------
    def epilogue(self, group, o_uid: int, outputs: list) -> dict:
        """Normalize, zero padded rows, run the pointwise epilogue, store; returns stem -> uid of
        the epilogue's loaded operands and stored outputs (their strides are arguments)."""
        w = self.line
        w("l_use = tl.where(l_i == 0.0, 1.0, l_i)")
        w("out = acc / l_use[:, None]")
        w("out = tl.where((rows < len_q)[:, None], out, 0.0)")
        if self.has("stats"):
            w("lse = tl.where(l_i == 0.0, float('-inf'), (m_i + tl.math.log2(l_use)) / "
              f"{LOG2E!r})")
            w(f"tl.store(stats_ptr + batch * stats_s0 + head * stats_s1 + rows * stats_s2, lse, mask=row_in)")
        w("o_mask = row_in[:, None] & (cols_dv[None, :] < VALUE_DIM)")
        self.emitter.bind(o_uid, "out", "f")
        extra = {}
        made = {o_uid} | {t.uid for n in group.epilogue for t in n.output_tensors()}
        for node in group.epilogue:
            for tensor in node.input_tensors():
                if tensor.uid in made or tensor.uid in self.emitter.values:
                    continue
                stem = self.names.prefix("epi")
                extra[stem] = tensor
                variable = self.names.fresh("loaded")
                w(f"{variable} = {self.emitter.loaded(self._tile_load(stem), tensor.data_type)}")
                self.emitter.bind(tensor.uid, variable, kind_of(tensor.data_type))
            self.emitter.emit(node)
            for text in self.emitter.lines:
                w(text)
            self.emitter.lines.clear()
        for tensor in outputs:
            stem = "o" if tensor.uid == o_uid else self.names.prefix("out")
            if stem != "o":
                extra[stem] = tensor
            w(f"tl.store({stem}_ptr + {self._tile_offsets(stem)}, "
              f"{self.emitter.stored(tensor.uid, tensor.data_type)}, mask=o_mask)")
        return extra

    def _tile_offsets(self, stem: str) -> str:
        cast = ".to(tl.int64)" if self.spec.wide_index else ""
        return (f"batch{cast} * {stem}_s0 + head{cast} * {stem}_s1 + rows[:, None]{cast} * {stem}_s2 + "
                f"cols_dv[None, :] * {stem}_s3")

    def _tile_load(self, stem: str) -> str:
        return f"tl.load({stem}_ptr + {self._tile_offsets(stem)}, mask=o_mask, other=0.0)"


def render(kernel_name: str, spec: AttentionSpec, group, o_uid: int, outputs: list, compute_type: str,
           description: str):
    """(source, arguments) of the forward kernel of an sdpa group under `spec`."""
    writer = _Writer(spec, compute_type)
    writer.prologue()
    writer.key_range()
    writer.loops()
    extra = writer.epilogue(group, o_uid, outputs)
    args = _arguments(spec, extra, writer.emitter.scalars)
    params = [a.name + (": tl.constexpr" if a.kind == "constexpr" else "") for a in args]
    source = header(description)
    if writer.emitter.globals:
        source += "\n" + "\n".join(writer.emitter.globals) + "\n"
    source += "\n\n@triton.jit\ndef " + kernel_name + "(\n" + "".join(f"    {p},\n" for p in params) + "):\n"
    return source + "\n".join(writer.body) + "\n", args


def output_strides(tensor, rank: int = 4) -> tuple:
    """Strides of a tensor read or written at the output position [B, H, Sq, Dv]: right-aligned,
    0 on broadcast axes."""
    dims, strides = (1,) * (rank - len(tensor.dim)) + tuple(tensor.dim), (0,) * (rank - len(tensor.dim)) + tuple(tensor.stride)
    return tuple(0 if d == 1 else s for d, s in zip(dims, strides))


def _arguments(spec: AttentionSpec, extra: dict, scalars) -> list:
    """Pointers, then sizes, strides per tensor, then the CAPITAL constexprs."""
    stems = [s for s in STRIDE_STEMS if s in spec.uids]
    args = [KernelArgument("tensor", f"{s}_ptr", spec.uids[s]) for s in stems]
    args += [KernelArgument("tensor", f"{s}_ptr", t.uid) for s, t in extra.items()]
    args += [KernelArgument("int", name, spec.dims[name]) for name in ("HEADS", "GROUP", "SQ", "SKV")]
    for stem in stems:
        args += [KernelArgument("int", f"{stem}_s{axis}", value) for axis, value in enumerate(spec.strides[stem])]
    for stem, tensor in extra.items():
        args += [KernelArgument("int", f"{stem}_s{axis}", value) for axis, value in enumerate(output_strides(tensor))]
    if spec.dropout is not None:
        args += [KernelArgument("int", "seed", spec.dropout[1]), KernelArgument("int", "offset", spec.dropout[2])]
    args += [KernelArgument("int", name, value) for name, value in scalars]
    args += [KernelArgument("constexpr", "HEAD_DIM", spec.dims["HEAD_DIM"]),
             KernelArgument("constexpr", "VALUE_DIM", spec.dims["VALUE_DIM"])]
    if spec.page_size:
        args.append(KernelArgument("constexpr", "PAGE", spec.page_size))
    block_m, block_n, block_d, block_dv = spec.block
    args += [KernelArgument("constexpr", "BLOCK_M", block_m), KernelArgument("constexpr", "BLOCK_N", block_n),
             KernelArgument("constexpr", "BLOCK_D", block_d), KernelArgument("constexpr", "BLOCK_DV", block_dv)]
    return args
