"""The flash-attention forward kernel of an sdpa group, rendered from an AttentionSpec.

One program: BLOCK_M queries of one (batch, head). It walks the key blocks its mask lets it see
in three runs: masked blocks before the fully visible ones (a left bound), the fully visible
blocks with no mask arithmetic at all, and masked blocks after them (the diagonal of a causal
mask, the last partial block, a right bound). The block's body is written once, as a generated
device function (`attend_blocks`, MASKED a constexpr) the kernel calls for each run. Per block:

    s = (q k^T) * scale * log2(e)  [+ bias * log2(e)]      scores in base 2
    m_new = max(m, rowmax(s)); p = exp2(s - m_new); alpha = exp2(m - m_new)
    l = l * alpha + rowsum(p);  acc = acc * alpha + p v     (p dropped out after l counts it)

1/l is applied once in the epilogue; a row that sees no key keeps m = -inf and l = 0 and is
written as zeros (its stats -inf). Every identifier is fixed here or drawn from the kernel's
NameAllocator; user names reach comments only. The epilogue (pointwise consumers of o) goes
through the shared ExpressionEmitter at the output position.
"""
from __future__ import annotations

import ast
import builtins
import difflib
from dataclasses import dataclass, field
from typing import Optional

from ....ops.dropout import keep_threshold
from .conversions import converted_to
from .emitter import ExpressionEmitter, element_load, kind_of
from .grid import FOLDED_PID, folded_program_ids
from .names import MODULE_ALIASES, NameAllocator
from ...contract import KernelSource
from .pointwise import KernelArgument, kernel_module, signature

LOG2E = 1.4426950408889634

# A ragged operand's stem -> the stem of its offsets ([B + 1] ints, read where a dense operand
# adds batch * stride[0]).
RAGGED_STEMS = {"q": "qrag", "k": "krag", "v": "vrag", "o": "orag", "do": "dorag", "dq": "dqrag", "dk": "dkrag",
                "dv": "dvrag"}

# Identifiers the template writes literally.
FIXED = ("pid_m", "pid_bh", "batch", "head", "kv_head", "rows", "cols_d", "cols_dv", "row_in",
         "len_q", "len_kv", "shift", "lo", "hi", "full_lo", "full_hi", "q_tile", "m_i", "l_i", "acc",
         "start_n", "keys", "key_in", "k_rows", "v_rows", "k_tile", "v_tile", "scores", "visible",
         "m_new", "m_use", "p_tile", "alpha", "l_use", "out", "lse", "bias_tile", "k_page", "v_page",
         "k_base", "v_base", "q_base", "keep", "counter", "qk_scale", "run_a", "run_b", "o_mask",
         "q_ptr", "k_ptr", "v_ptr", "o_ptr", "stats_ptr", "bias_ptr", "lenq_ptr", "lenkv_ptr",
         "ktab_ptr", "vtab_ptr", FOLDED_PID, "HEADS", "GROUP", "SQ", "SKV", "HEAD_DIM", "VALUE_DIM", "BLOCK_M",
         "BLOCK_N", "BLOCK_D", "BLOCK_DV", "PAGE", "PAGES", "seed", "offset",
         # the backward kernels
         "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "delta_ptr", "pid_n", "q_head", "do_tile", "o_tile",
         "lse_row", "delta_row", "dq_acc", "dk_acc", "dv_acc", "p_drop", "d_probs", "d_scores", "q_rows",
         "o_base", "do_base", "dq_base", "stats_base", "delta_base", "bias_base", "start_m",
         # decode packing, key splits and their combine
         "dbias_ptr", "dbias_acc", "bias_batch", "bias_head", "b_step", "h_step", "BATCH", "BIAS_HEADS",
         "q_pos", "first_pos", "last_pos", "bias_row", "drop_row", "part_row", "m_part", "o_part", "weight",
         "denom", "split", "opart_ptr", "lpart_ptr", "ROWS", "SPLITS", "CHUNK", "BLOCK_R",
         # the op-level backward (codegen/attention.py)
         "logits", "d_grad",
         # the generated device function walking one run of blocks (RUN_FUNCTION)
         "attend_blocks", "first", "last", "MASKED",
         # the softmax extras: a tensor scale, ALiBi, the sink token, the keys' row max and sum
         "sm_scale", "slope", "sink_logit", "m_sink", "p_sink", "dsink_acc", "scale_ptr", "sink_ptr", "smax_ptr",
         "ssum_ptr", "dsink_ptr",
         # ragged (THD) operands: each sequence's element offset in the packed buffer
         *(f"{stem}_ptr" for stem in RAGGED_STEMS.values()),
         # the block-sparse mask and v's own head count
         "bmask_ptr", "bmask_row", "bmask_base", "block_open", "MASK_M", "MASK_N", "GROUP_V", "v_head")
RUN_FUNCTION = "attend_blocks"
STRIDE_STEMS = ("q", "k", "v", "o", "stats", "bias", "lenq", "lenkv", "ktab", "vtab", "do", "dq", "dk", "dv",
                "dbias", "delta", "opart", "lpart", "seedt", "offt", "scale", "sink", "smax", "ssum", "dsink",
                *RAGGED_STEMS.values(), "bmask")
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
    packed: bool = False  # decode: a tile holds every query row of a K/V head's GROUP query heads
    splits: int = 1  # decode: programs per K/V head, each over CHUNK keys, merged by a combine kernel
    chunk: int = 0  # keys per split (a multiple of BLOCK_N)
    bias_dims: tuple = ()  # the dbias kernel: the bias's [B, H, Sq, Skv] (1 on the axes it sums over)
    stats_only: bool = False  # the log-sum-exp pass of an op-level backward: no v, no o
    head_group: int = 0  # programs of this many heads interleaved, their longest tiles first (0: off)
    folded_grid: bool = False  # the dbias kernel: (key tile, query tile, (batch, head)) from grid axis x
    stored_types: dict = field(default_factory=dict)  # backward: stem (dq, dk, dv, dbias) -> DataType
    alibi: bool = False  # scores += (key - query position) * the head's ALiBi slope


def _mask_argument(terms: list) -> str:
    """`, mask=..., other=0.0` of a load, or nothing when no term masks it."""
    return f", mask={' & '.join(terms)}, other=0.0" if terms else ""


def constexpr_branches(masked: list, unmasked: list, indent: str) -> list:
    """One body from a block's masked and unmasked renderings (lines at `indent`): the lines both
    share once, in order, and each stretch where they differ as `if MASKED:` (the masked lines)
    `else:` (the unmasked ones). MASKED is a constexpr, so Triton compiles exactly one rendering."""
    merged = []
    matcher = difflib.SequenceMatcher(None, masked, unmasked, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            merged += masked[i1:i2]
            continue
        # a stretch nested deeper than `indent` (inside a shared `if`) branches at its own depth
        here = min((line[:len(line) - len(line.lstrip())] for line in masked[i1:i2] + unmasked[j1:j2]),
                   key=len, default=indent)
        here = max(here, indent, key=len)
        merged.append(here + "if MASKED:")
        merged += ["    " + line for line in masked[i1:i2]] or [here + "    pass"]
        merged.append(here + "else:")
        merged += ["    " + line for line in unmasked[j1:j2]] or [here + "    pass"]
    return merged


def _names_in(lines: list) -> tuple:
    """(loaded, stored) identifiers of statement lines (one function body), in source order."""
    tree = ast.parse("def scope():\n" + "\n".join(lines))
    found = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Name)), key=lambda n: (n.lineno, n.col_offset))
    loaded = list(dict.fromkeys(n.id for n in found if isinstance(n.ctx, ast.Load)))
    stored = list(dict.fromkeys(n.id for n in found if isinstance(n.ctx, ast.Store)))
    return loaded, stored


def _free_names(body: list, kernel: list, bound: set) -> tuple:
    """(parameters, carried) of a device function with `body` called from a kernel whose lines so
    far are `kernel`: the names it reads from the kernel, and the kernel's values it assigns
    (returned to the kernel, in the order it first assigns them)."""
    loaded, stored = _names_in(body)
    in_kernel = set(_names_in(kernel)[1])
    outside = set(dir(builtins)) | MODULE_ALIASES | {"first", "last", "MASKED"} | bound
    carried = [name for name in stored if name in in_kernel]
    parameters = [name for name in loaded if name not in outside and (name not in stored or name in in_kernel)]
    return parameters + [name for name in carried if name not in parameters], carried


class ScoreModifier:
    """An op-level chain's score ops (rendered through the emitter on each [BLOCK_M, BLOCK_N]
    scores tile) and the side tensors they read at (batch, head, query, key)."""

    def __init__(self, scores_uid: int, nodes: list, made=()):
        self.scores_uid, self.nodes = scores_uid, list(nodes)
        made = {scores_uid, *made} | {t.uid for n in self.nodes for t in n.output_tensors()}
        self.sides = []
        for node in self.nodes:
            for tensor in node.input_tensors():
                if tensor.uid not in made and all(tensor is not t for t in self.sides):
                    self.sides.append(tensor)


def alibi_slope(head: str, heads: int) -> str:
    """The ALiBi slope of query head `head` (an expression) among `heads`, times log2(e) (the
    kernels' scores are base 2), as ops/sdpa.py's alibi_slopes defines it."""
    n = 1 << (heads.bit_length() - 1)
    first = f"tl.math.exp2(({head} + 1).to(tl.float32) * {-8.0 / n!r})"
    if n == heads:
        return f"{first} * {LOG2E!r}"
    rest = f"tl.math.exp2((2 * ({head} - {n}) + 1).to(tl.float32) * {-4.0 / n!r})"
    return f"tl.where({head} < {n}, {first}, {rest}) * {LOG2E!r}"


def _random_loads(writer, depth: int = 1):
    """seed and offset read from their one-element int64 tensors, where dropout names tensors."""
    for name, stem in (("seed", "seedt"), ("offset", "offt")):
        if writer.has(stem):
            writer.line(f"{name} = tl.load({stem}_ptr)", depth)


class _Writer:
    def __init__(self, spec: AttentionSpec, compute_type: str, modifier: Optional[ScoreModifier] = None):
        self.spec, self.body = spec, []
        self.names = NameAllocator(FIXED + STRIDE_NAMES)
        self.dot_options = f", input_precision=\"{spec.precision}\"" if spec.precision else ""
        self.emitter = ExpressionEmitter(compute_type, names=self.names, hint="e")
        self.modifier = modifier
        self.sides = {self.names.prefix("side"): t for t in modifier.sides} if modifier else {}
        self.modified: Optional[list] = None  # the score modifier's statements, rendered once
        self.helpers: list = []  # (name, parameters, body lines) of generated device functions

    def line(self, text: str, depth: int = 1):
        self.body.append("    " * depth + text)

    def has(self, stem: str) -> bool:
        return stem in self.spec.uids

    def scale_lines(self, depth: int = 1):
        """qk_scale, the base-2 score scale: a literal, or read from the one-element attn_scale
        tensor (sm_scale, which the backward's dQ and dK multiply by too)."""
        if self.has("scale"):
            self.line("sm_scale = tl.load(scale_ptr).to(tl.float32)", depth)
            self.line(f"qk_scale = sm_scale * {LOG2E!r}", depth)
        else:
            self.line(f"qk_scale = {self.spec.scale * LOG2E!r}", depth)

    def scale_value(self) -> str:
        return "sm_scale" if self.has("scale") else repr(self.spec.scale)

    def d_mask(self, axes: str) -> list:
        """The head-dim mask term of a load, none where BLOCK_D is the head dim."""
        return [] if self.spec.block[2] == self.spec.dims["HEAD_DIM"] else [f"(cols_d{axes} < HEAD_DIM)"]

    def dv_mask(self, axes: str) -> list:
        return [] if self.spec.block[3] == self.spec.dims["VALUE_DIM"] else [f"(cols_dv{axes} < VALUE_DIM)"]

    def stride(self, stem: str, axis: int) -> str:
        return f"{stem}_s{axis}"

    def split_heads(self) -> bool:
        """Whether k and v have their own head counts (GROUP query heads per k head, GROUP_V per
        v head)."""
        return "GROUP_V" in self.spec.dims

    def key_head(self, stem: str, depth: int, query_head: str = "") -> str:
        """The variable holding the k or v head (`stem`) of the query head being walked; v's
        own, v_head, is written here from `query_head` when v has its own head count."""
        if stem != "v" or not self.split_heads():
            return "kv_head"
        self.line(f"v_head = {query_head} // GROUP_V", depth)
        return "v_head"

    def ragged(self, stem: str) -> bool:
        """Whether operand `stem` is ragged: its sequences start at offsets, not at batch strides."""
        return stem in RAGGED_STEMS and self.has(RAGGED_STEMS[stem])

    def batch_term(self, stem: str, batch: str = "batch", cast: str = "") -> str:
        """The offset of batch `batch` in operand `stem`: its sequence's ragged offset (int64), or
        batch * stride[0]."""
        if self.ragged(stem):
            return f"tl.load({RAGGED_STEMS[stem]}_ptr + {batch}).to(tl.int64)"
        return f"{batch}{cast} * {self.stride(stem, 0)}"

    # --- program and query tile ---------------------------------------------------------------
    def prologue(self):
        """Program ids to (batch, query head, query position) per tile row, lengths, the q tile."""
        w, wide = self.line, self.spec.wide_index
        cast = ".to(tl.int64)" if wide else ""
        self.program_ids("pid_m")
        if self.spec.packed:  # rows are (query head of the group, position); pid_m is the split
            w("batch = pid_bh // (HEADS // GROUP)")
            w("kv_head = pid_bh % (HEADS // GROUP)")
            w("rows = tl.arange(0, BLOCK_M)")
            w("q_head = kv_head * GROUP + rows // SQ")
            w("q_pos = rows % SQ")
            w("row_in = rows < GROUP * SQ")
            w("first_pos = 0")
            w("last_pos = SQ - 1")
        else:
            w("batch = pid_bh // HEADS")
            w("q_head = pid_bh % HEADS")
            w("kv_head = q_head // GROUP")
            w("rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
            w("q_pos = rows")
            w("row_in = rows < SQ")
            w("first_pos = pid_m * BLOCK_M")
            w("last_pos = first_pos + BLOCK_M - 1")
        w("cols_d = tl.arange(0, BLOCK_D)")
        w("cols_dv = tl.arange(0, BLOCK_DV)")
        self.lengths_in_range()
        w("shift = " + ("len_kv - len_q" if self.spec.bottom_right else "0"))
        w(f"q_base = {self.row_base('q')}")
        # a ragged q's rows past len_q belong to the next sequence (or lie past the buffer): not read
        q_rows = ["row_in[:, None]"] + (["(q_pos < len_q)[:, None]"] if self.ragged("q") else [])
        w(f"q_tile = tl.load(q_ptr + q_base[:, None] + cols_d[None, :] * {self.stride('q', 3)}"
          f"{_mask_argument(q_rows + self.d_mask('[None, :]'))})")
        if self.has("bias"):
            w(f"bias_row = {self.row_base('bias')}")
        if self.has("bmask"):  # each row's mask row: (batch, head, position // MASK_M); the tile's when aligned
            cast = ".to(tl.int64)" if self.spec.wide_index else ""
            position = "first_pos" if self.mask_aligned() else "q_pos"
            w(f"bmask_row = batch{cast} * bmask_s0 + q_head{cast} * bmask_s1 + ({position} // MASK_M){cast} * bmask_s2")
        for stem in self.sides:
            w(f"{stem}_row = {self.row_base(stem)}")
        if self.spec.dropout is not None:
            w("drop_row = (batch.to(tl.int64) * HEADS + q_head) * SQ + q_pos")
        if not self.spec.page_size:
            for stem in ("k", "v") if self.has("v") else ("k",):
                head = self.key_head(stem, 1, "q_head")
                w(f"{stem}_base = {self.batch_term(stem, 'batch', cast)} + {head}{cast} * {self.stride(stem, 1)}")
        w("m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)")
        w("l_i = tl.zeros([BLOCK_M], tl.float32)")
        w("acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)")
        self.scale_lines()
        if self.spec.alibi:
            w(f"slope = tl.zeros([BLOCK_M], tl.float32) + {alibi_slope('q_head', self.spec.dims['HEADS'])}")
        _random_loads(self)

    def program_ids(self, tile: str, reverse: bool = True):
        """`tile` and pid_bh from the grid. With a head group G, axis 0 walks G heads' tiles
        interleaved, the longest first: query tiles from the last (`reverse`: later rows see
        more keys), dK/dV's key blocks from the first; axis 1 counts the groups."""
        w, group = self.line, self.spec.head_group
        if not group:
            w(f"{tile} = tl.program_id(0)")
            w("pid_bh = tl.program_id(1)")
            return
        w("pid_w = tl.program_id(0)")
        w(f"pid_bh = tl.program_id(1) * {group} + pid_w % {group}")
        w(f"{tile} = " + (f"tl.num_programs(0) // {group} - 1 - pid_w // {group}" if reverse else f"pid_w // {group}"))

    def length(self, stem: str, size: str, mask: str = "") -> str:
        """A per-batch length clamped to [0, size] in its own integer type, then int32 (a length
        past the axis means the whole axis; an int64 length is never truncated first)."""
        if not self.has(stem):
            return size
        load = f"tl.load({stem}_ptr + batch * {self.stride(stem, 0)}{mask})"
        return f"tl.minimum(tl.maximum({load}, 0), {size}).to(tl.int32)"

    def lengths_in_range(self):
        self.line(f"len_q = {self.length('lenq', 'SQ')}")
        self.line(f"len_kv = {self.length('lenkv', 'SKV')}")

    def row_base(self, stem: str) -> str:
        """[BLOCK_M] offsets of each tile row's (batch, query head, position) in a [B, H, Sq, .]
        tensor (batch may be a scalar, the head and position vectors)."""
        cast = ".to(tl.int64)" if self.spec.wide_index else ""
        return f"{self.batch_term(stem, 'batch', cast)} + q_head{cast} * {stem}_s1 + q_pos{cast} * {stem}_s2"

    def bounds(self) -> str:
        """The mask's bounds as lib.key_range/query_range take them: LEFT, RIGHT, HAS_LEFT, HAS_RIGHT
        (constexprs; an absent bound is 0 and its flag False)."""
        left, right = self.spec.left, self.spec.right
        return f"{left or 0}, {right or 0}, {left is not None}, {right is not None}"

    def key_range(self, padded_rows_idle: bool = False):
        """lo/hi bound the blocks any row sees; [full_lo, full_hi) those every row sees whole.
        `padded_rows_idle`: a tile whose rows all lie past len_q walks no key block (the dQ
        kernel, where such rows are exactly 0)."""
        w, spec = self.line, self.spec
        w(f"lo, hi, full_lo, full_hi = lib.key_range(first_pos, last_pos, shift, len_q, len_kv, {self.bounds()}, "
          f"{padded_rows_idle}, BLOCK_N)")
        if spec.splits > 1:  # this program's chunk of keys (chunks start on block edges)
            w("lo = tl.maximum(lo, pid_m * CHUNK)")
            w("hi = tl.minimum(hi, pid_m * CHUNK + CHUNK)")
        # the fully visible run starts and ends on block edges inside [lo, hi]
        w("run_a, run_b = lib.block_runs(lo, hi, full_lo, full_hi, BLOCK_N)")

    # --- one key block ------------------------------------------------------------------------
    def key_rows(self, stem: str, depth: int) -> str:
        """Offsets of the block's key rows in k or v (page_rows gathered them when paged)."""
        if not self.spec.page_size:
            keys = "keys.to(tl.int64)" if self.spec.wide_index else "keys"
            self.line(f"{stem}_rows = {stem}_base + {keys} * {self.stride(stem, 2)}", depth)
        return f"{stem}_rows"

    def page_rows(self, depth: int):
        """Paged K/V: the block's page ids from the k and v tables, and the keys' rows in the
        pools. A key whose id in either table lies outside [0, PAGES) is invisible, as if past
        len_kv (key_in), and its row offset is 0: whatever a table holds, no load leaves a pool."""
        w = self.line
        stems = ("k", "v") if self.has("v") else ("k",)
        for stem in stems:
            table = "ktab" if stem == "k" else "vtab"
            w(f"{stem}_page = tl.load({table}_ptr + batch * {self.stride(table, 0)} + (keys // PAGE) * "
              f"{self.stride(table, 2)}, mask=key_in, other=0).to(tl.int64)", depth)
        for stem in stems:
            w(f"key_in = key_in & ({stem}_page >= 0) & ({stem}_page < PAGES)", depth)
        for stem in stems:
            w(f"{stem}_rows = tl.where(key_in, {stem}_page, 0) * {self.stride(stem, 0)} + "
              f"kv_head.to(tl.int64) * {self.stride(stem, 1)} + (keys % PAGE) * {self.stride(stem, 2)}", depth)

    def block(self, masked: bool, depth: int):
        w, spec = self.line, self.spec
        w("keys = start_n + tl.arange(0, BLOCK_N)", depth)
        w("key_in = keys < len_kv", depth)
        if spec.page_size:  # a table may hide any key: every block is masked
            self.page_rows(depth)
            masked = True
        if self.has("bmask"):  # a block mask may hide any key: a block is skipped, or masked where it cuts the tile
            depth, cut = self.sparse_gate("bmask_row[:, None]", "row_in[:, None]", "keys[None, :]", depth,
                                          "bmask_row + (start_n // MASK_N) * bmask_s3")
            masked = masked or cut
        k_rows = self.key_rows("k", depth)
        terms = (["key_in[None, :]"] if masked else []) + self.d_mask("[:, None]")
        w(f"k_tile = tl.load(k_ptr + {k_rows}[None, :] + cols_d[:, None] * {self.stride('k', 3)}"
          f"{_mask_argument(terms)})", depth)
        if not masked and self.modifier is None and not self.has("bias") and not self.has("scale") and \
                not spec.alibi and spec.scale > 0:
            self.plain_probabilities(depth)
        else:
            self.probabilities(masked, depth)
        self.accumulate(masked, depth)

    def mask_aligned(self) -> bool:
        """Whether every tile lies inside one block of the block mask: its blocks are whole
        multiples of the tiles (which start on their own edges), and a tile's rows are of one head
        (not a packed decode tile)."""
        dims, block = self.spec.dims, self.spec.block
        return self.has("bmask") and not self.spec.packed and dims["MASK_M"] % block[0] == 0 and \
            dims["MASK_N"] % block[1] == 0

    def element_masked(self) -> bool:
        """Whether the block mask's entries join each tile's visibility (block_open): where a mask
        block may cut a tile."""
        return self.has("bmask") and not self.mask_aligned()

    def sparse_gate(self, mask_rows: str, rows_in: str, keys: str, depth: int, tile_entry: str) -> tuple:
        """An `if` that skips a tile no entry of the block mask opens: its loads and products never
        run. Aligned (mask_aligned), the tile's one entry (at offset `tile_entry`) decides and
        the tile is whole; otherwise the entries of each (row, key) are gathered (block_open, laid
        out as `mask_rows` (offsets of the rows' mask rows) and `keys` lay them) and join the
        tile's mask. Returns (the body's depth, whether the block mask cuts the tile)."""
        if self.mask_aligned():
            self.line(f"if tl.load(bmask_ptr + {tile_entry}) != 0:", depth)
            return depth + 1, False
        self.line(f"block_open = tl.load(bmask_ptr + {mask_rows} + ({keys} // MASK_N) * bmask_s3, "
                  f"mask={rows_in} & ({keys} < SKV), other=0) != 0", depth)
        self.line("if tl.max(block_open.to(tl.int32)) > 0:", depth)
        return depth + 1, True

    def plain_probabilities(self, depth: int):
        """p of a fully visible block of plain scores: they are finite, so m_new is too once any
        block has been seen, and the scale rides in the row max and one multiply-add per score
        (measured 4-7% faster than scaling the scores first on the H100)."""
        w = self.line
        w(f"scores = tl.dot(q_tile, k_tile{self.dot_options})", depth)
        w("m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)", depth)
        w("p_tile = tl.math.exp2(scores * qk_scale - m_new[:, None])", depth)
        w("alpha = tl.math.exp2(m_i - m_new)", depth)

    def probabilities(self, masked: bool, depth: int):
        """p of a block: base-2 scores (modified, biased, masked), the running max guarded for
        rows that have seen no key yet."""
        w, spec = self.line, self.spec
        if self.modifier is not None:
            self.modified_scores(depth)
        else:  # the product alone first: the one line a block's renderings share with the plain path
            w(f"scores = tl.dot(q_tile, k_tile{self.dot_options})", depth)
            w("scores = scores * qk_scale", depth)
        if self.has("bias"):
            keys = "keys[None, :].to(tl.int64)" if spec.wide_index else "keys[None, :]"
            w(f"bias_tile = tl.load(bias_ptr + bias_row[:, None] + {keys} * {self.stride('bias', 3)}, "
              "mask=row_in[:, None] & key_in[None, :], other=0.0)", depth)
            w(f"scores += bias_tile.to(tl.float32) * {LOG2E!r}", depth)
        if spec.alibi:
            w("scores += (keys[None, :] - q_pos[:, None]).to(tl.float32) * slope[:, None]", depth)
        if masked:
            w("visible = key_in[None, :] & (q_pos[:, None] >= 0)" + (" & block_open" if self.element_masked() else ""),
              depth)
            if spec.right is not None:
                w(f"visible = visible & (keys[None, :] - (q_pos[:, None] + shift) <= {spec.right})", depth)
            if spec.left is not None:
                w(f"visible = visible & ((q_pos[:, None] + shift) - keys[None, :] < {spec.left})", depth)
            w("scores = tl.where(visible, scores, float('-inf'))", depth)
        w("m_new = tl.maximum(m_i, tl.max(scores, 1))", depth)
        # rows that have seen no key yet keep m = -inf: subtract 0 there (exp2(-inf) = 0, no NaN)
        w("m_use = tl.where(m_new == float('-inf'), 0.0, m_new)", depth)
        w("p_tile = tl.math.exp2(scores - m_use[:, None])", depth)
        w("alpha = tl.math.exp2(m_i - m_use)", depth)

    def accumulate(self, masked: bool, depth: int):
        """l and acc rescaled by alpha and grown by the block's p (dropped out after l counts it)."""
        w, spec = self.line, self.spec
        w("l_i = l_i * alpha + tl.sum(p_tile, 1)", depth)
        if spec.stats_only:
            w("m_i = m_new", depth)
            return
        if spec.dropout is not None:
            p = spec.dropout[0]
            w("counter = drop_row[:, None] * SKV + keys[None, :]", depth)
            w(f"p_tile, keep = tm.dropout(p_tile, seed, offset, counter, {keep_threshold(p)}, "
              f"{1.0 / (1.0 - p)!r})", depth)
        v_rows = self.key_rows("v", depth)
        terms = (["key_in[:, None]"] if masked else []) + self.dv_mask("[None, :]")
        w(f"v_tile = tl.load(v_ptr + {v_rows}[:, None] + cols_dv[None, :] * {self.stride('v', 3)}"
          f"{_mask_argument(terms)})", depth)
        w(f"acc = acc * alpha[:, None] + tl.dot(p_tile.to(v_tile.dtype), v_tile{self.dot_options})", depth)
        w("m_i = m_new", depth)

    def modified_scores(self, depth: int):
        """scores = the chain's ops on q k^T (side tensors loaded at this block), in base 2: the
        same statements in every block (rendered once)."""
        if self.modified is None:
            self.modified = self._modified_statements()
        for text in self.modified:
            self.line(text, depth)

    def _modified_statements(self) -> list:
        lines = [f"scores = tl.dot(q_tile, k_tile{self.dot_options})"]
        self.emitter.bind(self.modifier.scores_uid, "scores", "f")
        for stem, tensor in self.sides.items():
            variable = self.names.fresh("sval")
            load = element_load(f"{stem}_ptr", f"{stem}_row[:, None] + keys[None, :] * {stem}_s3",
                                "row_in[:, None] & key_in[None, :]", tensor.data_type)
            lines.append(f"{variable} = {self.emitter.loaded(load, tensor.data_type)}")
            self.emitter.bind(tensor.uid, variable, kind_of(tensor.data_type))
        for node in self.modifier.nodes:
            self.emitter.emit(node)
        lines += self.emitter.lines
        self.emitter.lines.clear()
        final = self.modifier.nodes[-1].outputs[0].uid if self.modifier.nodes else self.modifier.scores_uid
        return lines + [f"scores = {self.emitter.value(final, 'f')} * {LOG2E!r}"]

    def block_loops(self, variable: str, step: str, block, depth: int = 1):
        """The loops over [lo, run_a) masked, [run_a, run_b) whole, [run_b, hi) masked, as three
        calls of one generated device function (RUN_FUNCTION, inlined by Triton) whose body
        `block(masked, depth)` renders once: lines both renderings share, the rest under
        `if MASKED:` / `else:`, resolved at compile time to exactly that rendering."""
        before = self.body
        renderings = []
        for masked in (True, False):
            self.body = []
            block(masked, 2)
            renderings.append(self.body)
        self.body = before
        body = [f"    for {variable} in range(first, last, {step}):"] + constexpr_branches(*renderings, "        ")
        parameters, carried = _free_names(body, before, {variable})
        self.helpers.append((RUN_FUNCTION, ["first", "last"] + parameters + ["MASKED"],
                             body + [f"    return {', '.join(carried)}"]))
        for first, last, masked in (("lo", "run_a", True), ("run_a", "run_b", False), ("run_b", "hi", True)):
            self.line(f"{', '.join(carried)} = {RUN_FUNCTION}({first}, {last}, {', '.join(parameters)}, {masked})",
                      depth)

    def loops(self):
        self.block_loops("start_n", "BLOCK_N", self.block)

    def helper_texts(self, args: list) -> list:
        """The generated device functions' texts; a parameter the kernel takes as a constexpr is
        one of theirs too (MASKED always)."""
        constexprs = {a.name for a in args if a.kind == "constexpr"} | {"MASKED"}
        texts = []
        for name, parameters, body in self.helpers:
            params = [KernelArgument("constexpr" if p in constexprs else "value", p, None) for p in parameters]
            texts.append(signature(name, params).lstrip("\n") + "\n".join(body) + "\n")
        return texts

    # --- epilogue -----------------------------------------------------------------------------
    def row_scores(self):
        """The keys' row max (natural units) and sum of exp(score - max), before the sink joins."""
        for stem, value in (("smax", f"m_i / {LOG2E!r}"), ("ssum", "l_i")):
            if self.has(stem):
                self.line(f"tl.store({stem}_ptr + {self.row_base(stem)}, {value}, mask=row_in)")

    def fold_sink(self):
        """The sink token joins the denominator once every key is seen: one more 'key' with logit
        sink and no value (acc is rescaled, not grown). A row that saw no key keeps acc = 0 and
        l = 1 under m = sink: o = 0, stats = the sink."""
        if not self.has("sink"):
            return
        w = self.line
        # a packed tile's rows past GROUP * SQ name heads past H: masked, no load leaves the sinks
        mask = ", mask=row_in, other=0.0" if self.spec.packed else ""
        w(f"sink_logit = tl.load(sink_ptr + q_head * sink_s1{mask}).to(tl.float32) * {LOG2E!r}")
        w("m_sink = tl.maximum(m_i, sink_logit)")
        w("m_use = tl.where(m_sink == float('-inf'), 0.0, m_sink)")
        w("alpha = tl.math.exp2(m_i - m_use)")
        w("l_i = l_i * alpha + tl.math.exp2(sink_logit - m_use)")
        w("acc = acc * alpha[:, None]")
        w("m_i = m_sink")

    def normalize(self):
        """o = acc / l and the natural-log stats (-inf for a row that saw no key)."""
        w = self.line
        w("l_use = tl.where(l_i == 0.0, 1.0, l_i)")
        w("out = acc / l_use[:, None]")
        if self.modifier is not None:  # an op-level softmax of a row of -inf is NaN, as in torch
            w("out = tl.where((l_i == 0.0)[:, None], float('nan'), out)")
        w(f"lse = tl.where(l_i == 0.0, float('-inf'), (m_i + tl.math.log2(l_use)) / {LOG2E!r})")

    def store_stats(self):
        """The natural-log log-sum-exp of each row (-inf for a row that saw no key), alone."""
        w = self.line
        w("l_use = tl.where(l_i == 0.0, 1.0, l_i)")
        w(f"lse = tl.where(l_i == 0.0, float('-inf'), (m_i + tl.math.log2(l_use)) / {LOG2E!r})")
        w(f"tl.store(stats_ptr + {self.row_base('stats')}, lse, mask=row_in)")

    def store_partials(self):
        """A split's normalized o and base-2 log-sum-exp, for the combine kernel."""
        w = self.line
        w("l_use = tl.where(l_i == 0.0, 1.0, l_i)")
        w("part_row = ((batch * HEADS + q_head) * SQ + q_pos).to(tl.int64) * SPLITS + pid_m")
        w("tl.store(lpart_ptr + part_row, tl.where(l_i == 0.0, float('-inf'), m_i + tl.math.log2(l_use)), "
          "mask=row_in)")
        w("tl.store(opart_ptr + part_row[:, None] * BLOCK_DV + cols_dv[None, :], acc / l_use[:, None], "
          "mask=row_in[:, None])")

    def finish(self, group, o_uid: int, outputs: list) -> dict:
        """Zero padded query rows, store stats, run the pointwise epilogue on o and store it;
        returns stem -> tensor of the epilogue's loaded operands and extra stored outputs."""
        w = self.line
        w("out = tl.where((q_pos < len_q)[:, None], out, 0.0)")
        if self.has("stats"):
            w(f"tl.store(stats_ptr + {self.row_base('stats')}, lse, mask=row_in)")
        # a ragged o's rows past len_q are the next sequence's: not written
        w("o_mask = row_in[:, None] & (cols_dv[None, :] < VALUE_DIM)"
          + (" & (q_pos < len_q)[:, None]" if self.ragged("o") else ""))
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
        return f"({self.row_base(stem)})[:, None] + cols_dv[None, :] * {stem}_s3"

    def _tile_load(self, stem: str) -> str:
        return f"tl.load({stem}_ptr + {self._tile_offsets(stem)}, mask=o_mask, other=0.0)"

    # --- the combine kernel of a split decode -------------------------------------------------
    def combine(self):
        """Per query row: merge the splits' (o, log-sum-exp) weighted by exp2(lse - max)."""
        w = self.line
        w("rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)")
        w("row_in = rows < ROWS")
        w("batch = rows // (HEADS * SQ)")
        w("q_head = rows // SQ % HEADS")
        w("q_pos = rows % SQ")
        w("cols_dv = tl.arange(0, BLOCK_DV)")
        w(f"len_q = {self.length('lenq', 'SQ', ', mask=row_in, other=0')}")
        w("m_i = tl.full([BLOCK_R], float('-inf'), tl.float32)")
        w("for split in range(SPLITS):")
        w("m_part = tl.load(lpart_ptr + rows.to(tl.int64) * SPLITS + split, mask=row_in, other=float('-inf'))", 2)
        w("m_i = tl.maximum(m_i, m_part)", 2)
        w("m_use = tl.where(m_i == float('-inf'), 0.0, m_i)")
        w("denom = tl.zeros([BLOCK_R], tl.float32)")
        w("acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)")
        w("for split in range(SPLITS):")
        w("part_row = rows.to(tl.int64) * SPLITS + split", 2)
        w("weight = tl.math.exp2(tl.load(lpart_ptr + part_row, mask=row_in, other=float('-inf')) - m_use)", 2)
        w("denom += weight", 2)
        w("o_part = tl.load(opart_ptr + part_row[:, None] * BLOCK_DV + cols_dv[None, :], "
          "mask=row_in[:, None], other=0.0)", 2)
        w("acc += weight[:, None] * o_part", 2)
        w("l_use = tl.where(denom == 0.0, 1.0, denom)")
        w("out = acc / l_use[:, None]")
        w(f"lse = tl.where(denom == 0.0, float('-inf'), (m_use + tl.math.log2(l_use)) / {LOG2E!r})")


def render(kernel_name: str, spec: AttentionSpec, group, o_uid: int, outputs: list, compute_type: str,
           description: str, modifier: Optional[ScoreModifier] = None):
    """The KernelSource (name, source, arguments) of the forward kernel of an sdpa group (or an op-level attention chain,
    whose score ops are `modifier`) under `spec`."""
    writer = _Writer(spec, compute_type, modifier)
    writer.prologue()
    writer.key_range()
    writer.loops()
    extra = dict(writer.sides)
    if spec.splits > 1:
        writer.store_partials()
    elif spec.stats_only:
        writer.store_stats()
    else:
        writer.row_scores()
        writer.fold_sink()
        writer.normalize()
        extra.update(writer.finish(group, o_uid, outputs))
    args = attention_arguments(spec, extra, writer.emitter.scalars)
    return KernelSource(kernel_name, kernel_module(description, writer.emitter.globals, kernel_name, args,
                                                   "\n".join(writer.body) + "\n", libraries=("lib",),
                                                   helpers=writer.helper_texts(args)), args)


def render_combine(kernel_name: str, spec: AttentionSpec, group, o_uid: int, outputs: list, compute_type: str,
                   rows_per_program: int, description: str):
    """The KernelSource (name, source, arguments) of the kernel merging a split decode's partials into o and stats."""
    writer = _Writer(spec, compute_type)
    writer.combine()
    extra = writer.finish(group, o_uid, outputs)
    stems = [s for s in ("opart", "lpart", "o", "stats", "lenq") if s in spec.uids]
    args = [KernelArgument("tensor", f"{s}_ptr", spec.uids[s]) for s in stems]
    args += [KernelArgument("tensor", f"{s}_ptr", t.uid) for s, t in extra.items()]
    problem_rows = spec.dims["ROWS"]
    args += [KernelArgument("int", name, spec.dims[name]) for name in ("HEADS", "SQ")]
    args.append(KernelArgument("int", "ROWS", problem_rows))
    for stem in stems:
        args += [KernelArgument("int", f"{stem}_s{axis}", value) for axis, value in enumerate(spec.strides[stem])]
    for stem, tensor in extra.items():
        args += [KernelArgument("int", f"{stem}_s{axis}", value) for axis, value in enumerate(output_strides(tensor))]
    args += [KernelArgument("int", name, value) for name, value in writer.emitter.scalars]
    args += [KernelArgument("constexpr", "VALUE_DIM", spec.dims["VALUE_DIM"]),
             KernelArgument("constexpr", "SPLITS", spec.splits), KernelArgument("constexpr", "BLOCK_R", rows_per_program),
             KernelArgument("constexpr", "BLOCK_DV", spec.block[3])]
    return KernelSource(kernel_name, kernel_module(description, writer.emitter.globals, kernel_name, args,
                                                   "\n".join(writer.body) + "\n"), args)


def output_strides(tensor, rank: int = 4) -> tuple:
    """Strides of a tensor read or written at the output position [B, H, Sq, Dv]: right-aligned,
    0 on broadcast axes."""
    dims, strides = (1,) * (rank - len(tensor.dim)) + tuple(tensor.dim), (0,) * (rank - len(tensor.dim)) + tuple(tensor.stride)
    return tuple(0 if d == 1 else s for d, s in zip(dims, strides))


def attention_arguments(spec: AttentionSpec, extra: dict, scalars) -> list:
    """Pointers, then sizes, strides per tensor, then the CAPITAL constexprs."""
    stems = [s for s in STRIDE_STEMS if s in spec.uids]
    args = [KernelArgument("tensor", f"{s}_ptr", spec.uids[s]) for s in stems]
    args += [KernelArgument("tensor", f"{s}_ptr", t.uid) for s, t in extra.items()]
    args += [KernelArgument("int", name, spec.dims[name]) for name in ("HEADS", "GROUP", "GROUP_V", "SQ", "SKV",
                                                                       "BATCH", "BIAS_HEADS") if name in spec.dims]
    for stem in stems:
        args += [KernelArgument("int", f"{stem}_s{axis}", value) for axis, value in enumerate(spec.strides[stem])]
    for stem, tensor in extra.items():
        args += [KernelArgument("int", f"{stem}_s{axis}", value) for axis, value in enumerate(output_strides(tensor))]
    if spec.dropout is not None:
        args += [KernelArgument("int", name, value) for name, value in zip(("seed", "offset"), spec.dropout[1:])
                 if value is not None]
    args += [KernelArgument("int", name, value) for name, value in scalars]
    args += [KernelArgument("constexpr", "HEAD_DIM", spec.dims["HEAD_DIM"]),
             KernelArgument("constexpr", "VALUE_DIM", spec.dims["VALUE_DIM"])]
    if spec.page_size:
        args += [KernelArgument("int", "PAGES", spec.dims["PAGES"]), KernelArgument("constexpr", "PAGE", spec.page_size)]
    args += [KernelArgument("constexpr", name, spec.dims[name]) for name in ("MASK_M", "MASK_N") if name in spec.dims]
    if spec.splits > 1:
        args += [KernelArgument("constexpr", "SPLITS", spec.splits), KernelArgument("constexpr", "CHUNK", spec.chunk)]
    block_m, block_n, block_d, block_dv = spec.block
    args += [KernelArgument("constexpr", "BLOCK_M", block_m), KernelArgument("constexpr", "BLOCK_N", block_n),
             KernelArgument("constexpr", "BLOCK_D", block_d), KernelArgument("constexpr", "BLOCK_DV", block_dv)]
    return args


# --- backward -------------------------------------------------------------------------------------
# Three kernels, no atomics (bitwise reproducible): delta = rowsum(o * dO) per query row; dK and
# dV per key block, walking the query blocks that see it for every query head of its group (GQA
# sums in registers); dQ per query block, walking its key blocks as the forward does. Scores are
# recomputed in base 2 against the stored log-sum-exp; dS = P * (dP - delta).
class BackwardWriter(_Writer):
    def stored_as(self, stem: str, value: str) -> str:
        """`value` converted for the store to gradient `stem`'s data type (conversions.py)."""
        return converted_to(value, "f", self.spec.stored_types[stem])

    def lengths(self):
        w = self.line
        self.lengths_in_range_at(1)
        self.scale_lines()
        _random_loads(self)

    def head_offsets(self, head: str, depth: int):
        """Base offsets of one query head's rows in q, dO, o, stats, delta and bias."""
        wide = ".to(tl.int64)" if self.spec.wide_index else ""
        for stem in ("q", "do", "o", "stats", "delta", "bias", "dq", "bmask"):
            if self.has(stem):
                self.line(f"{stem}_base = {self.batch_term(stem, 'batch', wide)} + {head}{wide} * {stem}_s1", depth)

    def row_loads(self, rows: str, depth: int, masked: bool, transposed: bool):
        """q, dO, the base-2 lse and delta of query rows `rows`; rows past len_q load dO = 0 and
        an lse of +inf, so their probabilities are 0 (no NaN from 0 x inf)."""
        w, wide = self.line, ".to(tl.int64)" if self.spec.wide_index else ""
        row_in = ["row_in[:, None]"] if masked else []
        w(f"row_in = {rows} < len_q", depth)
        w(f"q_tile = tl.load(q_ptr + q_base + {rows}[:, None]{wide} * q_s2 + cols_d[None, :] * q_s3"
          f"{_mask_argument(row_in + self.d_mask('[None, :]'))})", depth)
        w(f"do_tile = tl.load(do_ptr + do_base + {rows}[:, None]{wide} * do_s2 + cols_dv[None, :] * do_s3"
          f"{_mask_argument(['row_in[:, None]'] + self.dv_mask('[None, :]'))})", depth)
        w(f"lse_row = tl.load(stats_ptr + stats_base + {rows} * stats_s2, mask=row_in, other=0.0)", depth)
        # an op-level softmax of a row that sees no key is NaN, and so are its probabilities
        empty = "float('nan')" if self.modifier is not None else "float('inf')"
        w(f"lse_row = tl.where(row_in & (lse_row > float('-inf')), lse_row * {LOG2E!r}, "
          f"tl.where(row_in, {empty}, float('inf')))", depth)
        if self.has("delta"):
            w(f"delta_row = tl.load(delta_ptr + delta_base + {rows} * delta_s2, mask=row_in, other=0.0)", depth)
        elif self.has("o"):  # no workspace for the preprocess: the row sums here
            w(f"o_tile = tl.load(o_ptr + o_base + {rows}[:, None]{wide} * o_s2 + cols_dv[None, :] * o_s3"
              f"{_mask_argument(['row_in[:, None]'] + self.dv_mask('[None, :]'))})", depth)
            w("delta_row = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)", depth)
        # dO meets v and p on the tensor cores in q, k and v's type (an fp32 dO made of a graph's
        # intermediate values converts after the row sums, as the precision rule converts operands)
        w("do_tile = do_tile.to(q_ptr.dtype.element_ty)", depth)

    def scores(self, rows: str, keys: str, transposed: bool, masked: bool, depth: int):
        """Probabilities of (rows, keys), [BLOCK_N, BLOCK_M] when transposed (dK/dV) else
        [BLOCK_M, BLOCK_N], from the base-2 logits and the row's log-sum-exp (dropped out too)."""
        w, spec = self.line, self.spec
        r, c = (f"{rows}[None, :]", f"{keys}[:, None]") if transposed else (f"{rows}[:, None]", f"{keys}[None, :]")
        product = "tl.dot(k_tile, tl.trans(q_tile)" if transposed else "tl.dot(q_tile, tl.trans(k_tile)"
        logits = self.logits(f"{product}{self.dot_options})", rows, keys, r, c, transposed, masked, depth)
        lse = "lse_row[None, :]" if transposed else "lse_row[:, None]"
        w(f"p_tile = tl.math.exp2({logits} - {lse})", depth)
        if spec.dropout is not None:
            p = spec.dropout[0]
            w(f"counter = ((batch.to(tl.int64) * HEADS + head) * SQ + {r}) * SKV + {c}", depth)
            w(f"p_drop, keep = tm.dropout(p_tile, seed, offset, counter, {keep_threshold(p)}, {1.0 / (1.0 - p)!r})",
              depth)

    def logits(self, product: str, rows: str, keys: str, r: str, c: str, transposed: bool, masked: bool,
               depth: int) -> str:
        """The variable holding the base-2 scores of the block (`r`, `c`: rows and keys laid
        along the tile's axes); masked blocks get -inf where a key is not visible."""
        w, spec = self.line, self.spec
        w(f"scores = {product} * qk_scale", depth)
        if self.has("bias"):
            # loaded [queries, keys] as in the forward, then transposed for the dK/dV tile
            wide = ".to(tl.int64)" if spec.wide_index else ""
            w(f"bias_tile = tl.load(bias_ptr + bias_base + {rows}[:, None]{wide} * bias_s2 + {keys}[None, :]{wide} * "
              f"bias_s3, "
              f"mask=({rows}[:, None] < len_q) & ({keys}[None, :] < len_kv), other=0.0)", depth)
            bias = "tl.trans(bias_tile)" if transposed else "bias_tile"
            w(f"scores += {bias}.to(tl.float32) * {LOG2E!r}", depth)
        if spec.alibi:
            w(f"scores += ({c} - {r}).to(tl.float32) * {alibi_slope('head', spec.dims['HEADS'])}", depth)
        if masked:
            w(f"visible = ({c} < len_kv) & ({r} < len_q)" + (" & block_open" if self.element_masked() else ""), depth)
            if spec.right is not None:
                w(f"visible = visible & ({c} - ({r} + shift) <= {spec.right})", depth)
            if spec.left is not None:
                w(f"visible = visible & (({r} + shift) - {c} < {spec.left})", depth)
            w("scores = tl.where(visible, scores, float('-inf'))", depth)
        return "scores"

    def score_grad(self, which: str, masked: bool, depth: int) -> str:
        """The gradient of the scores that `which` ("dq", "dk") multiplies: dS itself here; an
        op-level chain takes it back through its score ops."""
        return "d_scores"

    def dropped(self, value: str, depth: int):
        """dP through the dropout mask (kept entries scaled by 1/(1-p), others 0)."""
        if self.spec.dropout is not None:
            self.line(f"{value} = tl.where(keep, {value} * {1.0 / (1.0 - self.spec.dropout[0])!r}, 0.0)", depth)

    def dkdv_block(self, masked: bool, depth: int):
        w = self.line
        w("q_rows = start_m + tl.arange(0, BLOCK_M)", depth)
        if self.has("bmask"):
            depth, cut = self.sparse_gate("bmask_base + (q_rows // MASK_M)[None, :] * bmask_s2",
                                          "(q_rows < SQ)[None, :]", "keys[:, None]", depth,
                                          "bmask_base + (start_m // MASK_M) * bmask_s2 + "
                                          "(pid_n * BLOCK_N // MASK_N) * bmask_s3")
            masked = masked or cut
        self.row_loads("q_rows", depth, masked, True)
        self.scores("q_rows", "keys", True, masked, depth)
        probs = "p_drop" if self.spec.dropout is not None else "p_tile"
        if self.has("dv"):
            w(f"dv_acc += tl.dot({probs}.to(do_tile.dtype), do_tile{self.dot_options})", depth)
        if self.has("dk"):
            w(f"d_probs = tl.dot(v_tile, tl.trans(do_tile){self.dot_options})", depth)
            self.dropped("d_probs", depth)
            w("d_scores = p_tile * (d_probs - delta_row[None, :])", depth)
            grad = self.score_grad("dk", masked, depth)
            w(f"dk_acc += tl.dot({grad}.to(q_tile.dtype), q_tile{self.dot_options})", depth)

    def key_operands(self) -> list:
        """(stem, columns, head-dim mask) of the key-side tiles a kernel loads: k, and v where dP
        is taken."""
        operands = [("k", "cols_d", self.d_mask("[None, :]"))]
        if self.has("v"):
            operands.append(("v", "cols_dv", self.dv_mask("[None, :]")))
        return operands

    def query_range(self):
        """lo/hi bound the query blocks that see any key of this block; [run_a, run_b) those
        whose every row sees every key of it (none when the block passes len_kv)."""
        w = self.line
        w(f"lo, hi, full_lo, full_hi = lib.query_range(pid_n * BLOCK_N, shift, len_q, len_kv, {self.bounds()}, "
          "BLOCK_M, BLOCK_N)")
        w("run_a, run_b = lib.block_runs(lo, hi, full_lo, full_hi, BLOCK_M)")

    def dkdv_kernel(self):
        """dK and dV of one key block of a k/v head, walking the query heads of its group. Where
        k and v have their own head counts the kernel stores one of them (a kernel per
        gradient): the owned operand's tile stays resident, the other's is loaded per query head."""
        w, wide = self.line, ".to(tl.int64)" if self.spec.wide_index else ""
        own = "GROUP_V" if self.split_heads() and not self.has("dk") else "GROUP"
        self.program_ids("pid_n", reverse=False)  # causal: the first key block sees the most queries
        w(f"batch = pid_bh // (HEADS // {own})")
        w(f"kv_head = pid_bh % (HEADS // {own})")
        self.lengths()
        w("keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        w("key_in = keys < len_kv")
        w("cols_d = tl.arange(0, BLOCK_D)")
        w("cols_dv = tl.arange(0, BLOCK_DV)")
        owned = {"GROUP": "k", "GROUP_V": "v"}[own]
        resident = [op for op in self.key_operands() if not self.split_heads() or op[0] == owned]
        walked = [op for op in self.key_operands() if op not in resident]
        for operand in resident:
            self.key_tile(operand, "kv_head", 1)
        for stem, shape in (("dk", "BLOCK_D"), ("dv", "BLOCK_DV")):
            if self.has(stem):
                w(f"{stem}_acc = tl.zeros([BLOCK_N, {shape}], tl.float32)")
        self.query_range()
        w(f"for q_head in range({own}):")
        w(f"head = kv_head * {own} + q_head", 2)
        self.head_offsets("head", 2)
        for operand in walked:  # its head: the query head's in the other grouping
            self.key_tile(operand, f"(head // {'GROUP' if owned == 'v' else 'GROUP_V'})", 2)
        self.block_loops("start_m", "BLOCK_M", self.dkdv_block, 2)
        for stem, acc, cols, mask, scale in (("dk", "dk_acc", "cols_d", self.d_mask("[None, :]"), True),
                                             ("dv", "dv_acc", "cols_dv", self.dv_mask("[None, :]"), False)):
            if not self.has(stem):
                continue
            # a ragged gradient's keys past len_kv are the next sequence's: not written
            store = ["key_in[:, None]" if self.ragged(stem) else "(keys < SKV)[:, None]"]
            value = f"{acc} * {self.scale_value()}" if scale else acc
            w(f"tl.store({stem}_ptr + {self.batch_term(stem, 'batch', wide)} + kv_head{wide} * {stem}_s1 + "
              f"keys[:, None]{wide} * "
              f"{stem}_s2 + {cols}[None, :] * {stem}_s3, {self.stored_as(stem, value)}, "
              f"mask={' & '.join(store + mask)})")

    def key_tile(self, operand: tuple, head: str, depth: int):
        """The key block's tile of k or v (`operand` as key_operands gives it) at head `head`."""
        stem, cols, mask = operand
        wide = ".to(tl.int64)" if self.spec.wide_index else ""
        self.line(f"{stem}_base = {self.batch_term(stem, 'batch', wide)} + {head}{wide} * {stem}_s1", depth)
        self.line(f"{stem}_tile = tl.load({stem}_ptr + {stem}_base + keys[:, None]{wide} * {stem}_s2 + "
                  f"{cols}[None, :] * {stem}_s3{_mask_argument(['key_in[:, None]'] + mask)})", depth)

    def dq_block(self, masked: bool, depth: int, accumulate: str = ""):
        """One key block of a query tile: dS, then dQ += dS k (or `accumulate`, the dbias kernel)."""
        w, wide = self.line, ".to(tl.int64)" if self.spec.wide_index else ""
        w("keys = start_n + tl.arange(0, BLOCK_N)", depth)
        w("key_in = keys < len_kv", depth)
        if self.has("bmask"):
            depth, cut = self.sparse_gate("bmask_base + (rows // MASK_M)[:, None] * bmask_s2", "(rows < SQ)[:, None]",
                                          "keys[None, :]", depth,
                                          "bmask_base + (first_pos // MASK_M) * bmask_s2 + (start_n // MASK_N) * bmask_s3")
            masked = masked or cut
        for stem, cols, mask in self.key_operands():
            keys = ["key_in[:, None]"] if masked else []
            w(f"{stem}_tile = tl.load({stem}_ptr + {stem}_base + keys[:, None]{wide} * {stem}_s2 + {cols}[None, :] * "
              f"{stem}_s3{_mask_argument(keys + mask)})", depth)
        self.scores("rows", "keys", False, masked, depth)
        w(f"d_probs = tl.dot(do_tile, tl.trans(v_tile){self.dot_options})", depth)
        self.dropped("d_probs", depth)
        w("d_scores = p_tile * (d_probs - delta_row[:, None])", depth)
        grad = self.score_grad("dq", masked, depth)
        w(accumulate or f"dq_acc += tl.dot({grad}.to(k_tile.dtype), k_tile{self.dot_options})", depth)

    def dq_kernel(self):
        w, wide = self.line, ".to(tl.int64)" if self.spec.wide_index else ""
        self.program_ids("pid_m")
        w("batch = pid_bh // HEADS")
        w("head = pid_bh % HEADS")
        w("kv_head = head // GROUP")
        self.lengths()
        w("rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        w("first_pos = pid_m * BLOCK_M")
        w("last_pos = first_pos + BLOCK_M - 1")
        w("cols_d = tl.arange(0, BLOCK_D)")
        w("cols_dv = tl.arange(0, BLOCK_DV)")
        self.head_offsets("head", 1)
        for stem, _, _ in self.key_operands():
            head = self.key_head(stem, 1, "head")
            w(f"{stem}_base = {self.batch_term(stem, 'batch', wide)} + {head}{wide} * {stem}_s1")
        self.row_loads("rows", 1, True, False)
        w("dq_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)")
        self.key_range(padded_rows_idle=True)
        self.block_loops("start_n", "BLOCK_N", self.dq_block)
        w(f"tl.store(dq_ptr + dq_base + rows[:, None]{wide} * dq_s2 + cols_d[None, :] * dq_s3, "
          f"{self.stored_as('dq', f'dq_acc * {self.scale_value()}')}, "
          f"mask={' & '.join([self._dq_rows()] + self.d_mask('[None, :]'))})")

    def _dq_rows(self) -> str:
        """The rows of dq a query tile stores: all of them, but only the sequence's when ragged."""
        return "(rows < len_q)[:, None]" if self.ragged("dq") else "(rows < SQ)[:, None]"

    def dbias_kernel(self):
        """dbias = dS summed over the axes the bias broadcasts over. A program owns one
        [BLOCK_M, BLOCK_N] tile of the bias and walks, recomputing P and dP, every (batch, head,
        query block) that reads it: no atomics, no workspace. A bias constant along the keys
        shifts each row's scores by one value, which softmax ignores: its gradient is exactly 0
        (sum_j P_ij (dP_ij - delta_i) = delta_i - delta_i, dropout included), stored as such."""
        w, spec = self.line, self.spec
        bias_b, bias_h, bias_q, bias_k = spec.bias_dims
        dims, wide = spec.dims, ".to(tl.int64)" if spec.wide_index else ""
        if spec.folded_grid:  # past grid axes y or z: every index from axis x, key tiles fastest
            tiles = (-(-bias_k // spec.block[1]), -(-bias_q // spec.block[0]))
            for line in folded_program_ids(("pid_n", "pid_m", "pid_bh"), tiles):
                w(line)
        else:
            w("pid_n = tl.program_id(0)")
            w("pid_m = tl.program_id(1)")
            w("pid_bh = tl.program_id(2)")
        w("bias_batch = pid_bh // BIAS_HEADS")
        w("bias_head = pid_bh % BIAS_HEADS")
        w("dbias_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)")
        if bias_k == dims["SKV"]:
            self._dbias_walk(bias_b == dims["BATCH"], bias_h == dims["HEADS"], bias_q == dims["SQ"])
        w("rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        w("keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)")
        rows_owned, keys_owned = bias_q == dims["SQ"], bias_k == dims["SKV"]
        value = "dbias_acc" if keys_owned else "tl.sum(dbias_acc, 1)"
        value = value if rows_owned else f"tl.sum({value}, 0)"
        rows = ("rows[:, None]" if keys_owned else "rows") if rows_owned else None
        keys = ("keys[None, :]" if rows_owned else "keys") if keys_owned else None
        offsets = f"bias_batch{wide} * dbias_s0 + bias_head{wide} * dbias_s1"
        offsets += f" + {rows}{wide} * dbias_s2" if rows else ""
        offsets += f" + {keys}{wide} * dbias_s3" if keys else ""
        mask = " & ".join(([f"({rows} < SQ)"] if rows else []) + ([f"({keys} < SKV)"] if keys else []))
        store_mask = f", mask={mask}" if mask else ""
        w(f"tl.store(dbias_ptr + {offsets}, {self.stored_as('dbias', value)}{store_mask})")

    def _dbias_walk(self, owns_batch: bool, owns_head: bool, owns_rows: bool):
        """dbias_acc += dS over the batches, heads and query blocks the program's tile gathers."""
        w, wide = self.line, ".to(tl.int64)" if self.spec.wide_index else ""
        self.scale_lines()
        _random_loads(self)
        w("cols_d = tl.arange(0, BLOCK_D)")
        w("cols_dv = tl.arange(0, BLOCK_DV)")
        depth = self._owned_or_walked("batch", "bias_batch", "b_step", "BATCH", owns_batch, 1)
        self.lengths_in_range_at(depth)
        depth = self._owned_or_walked("head", "bias_head", "h_step", "HEADS", owns_head, depth)
        w("kv_head = head // GROUP", depth)
        self.head_offsets("head", depth)
        for stem in ("k", "v"):
            head = self.key_head(stem, depth, "head")
            w(f"{stem}_base = {self.batch_term(stem, 'batch', wide)} + {head}{wide} * {stem}_s1", depth)
        if owns_rows:
            w("start_m = pid_m * BLOCK_M", depth)
        else:
            w("for start_m in range(0, len_q, BLOCK_M):", depth)
            depth += 1
        w("rows = start_m + tl.arange(0, BLOCK_M)", depth)
        if self.mask_aligned():  # the tile's row of the block mask
            w("first_pos = start_m", depth)
        self.row_loads("rows", depth, True, False)
        w("start_n = pid_n * BLOCK_N", depth)
        self.dq_block(True, depth, "dbias_acc += d_scores")

    def _owned_or_walked(self, variable: str, owned: str, step: str, count: str, owns: bool, depth: int) -> int:
        """`variable` is the program's own index when the bias spans the axis, else a loop over it."""
        if owns:
            self.line(f"{variable} = {owned}", depth)
            return depth
        self.line(f"for {step} in range(0, {count}):", depth)
        self.line(f"{variable} = tl.cast({step}, tl.int32)", depth + 1)
        return depth + 1

    def lengths_in_range_at(self, depth: int):
        """The per-batch lengths and the diagonal's shift at `depth` (inside a loop over batches)."""
        self.line(f"len_q = {self.length('lenq', 'SQ')}", depth)
        self.line(f"len_kv = {self.length('lenkv', 'SKV')}", depth)
        self.line("shift = " + ("len_kv - len_q" if self.spec.bottom_right else "0"), depth)

    def delta_kernel(self):
        w = self.line
        self.program_ids("pid_m")
        w("batch = pid_bh // HEADS")
        w("head = pid_bh % HEADS")
        self.lengths()
        w("rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)")
        w("cols_dv = tl.arange(0, BLOCK_DV)")
        self.head_offsets("head", 1)
        wide = ".to(tl.int64)" if self.spec.wide_index else ""
        w("row_in = rows < len_q")
        for stem in ("o", "do"):
            w(f"{stem}_tile = tl.load({stem}_ptr + {stem}_base + rows[:, None]{wide} * {stem}_s2 + cols_dv[None, :] * "
              f"{stem}_s3{_mask_argument(['row_in[:, None]'] + self.dv_mask('[None, :]'))})")
        w("delta_row = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)")
        w("tl.store(delta_ptr + delta_base + rows * delta_s2, delta_row, mask=rows < SQ)")


    def dsink_kernel(self):
        """dsink_h = -sum over (b, i < len_q) of p_sink * delta, p_sink = exp(sink - lse) (the
        stats count the sink), delta = rowsum(dO * o): a program per query head walks its rows
        (no atomics)."""
        w, wide = self.line, ".to(tl.int64)" if self.spec.wide_index else ""
        w("head = tl.program_id(0)")
        w("sink_logit = tl.load(sink_ptr + head * sink_s1).to(tl.float32)")
        w("dsink_acc = tl.zeros([BLOCK_M], tl.float32)")
        w("cols_dv = tl.arange(0, BLOCK_DV)")
        depth = self._owned_or_walked("batch", "", "b_step", "BATCH", False, 1)
        w(f"len_q = {self.length('lenq', 'SQ')}", depth)
        self.head_offsets("head", depth)
        w("for start_m in range(0, len_q, BLOCK_M):", depth)
        depth += 1
        w("rows = start_m + tl.arange(0, BLOCK_M)", depth)
        w("row_in = rows < len_q", depth)
        for stem in ("o", "do"):
            w(f"{stem}_tile = tl.load({stem}_ptr + {stem}_base + rows[:, None]{wide} * {stem}_s2 + cols_dv[None, :] * "
              f"{stem}_s3{_mask_argument(['row_in[:, None]'] + self.dv_mask('[None, :]'))})", depth)
        w("delta_row = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1)", depth)
        w("lse_row = tl.load(stats_ptr + stats_base + rows * stats_s2, mask=row_in, other=float('inf'))", depth)
        w("p_sink = tl.where(row_in, tl.exp(sink_logit - lse_row), 0.0)", depth)
        w("dsink_acc += p_sink * delta_row", depth)
        w(f"tl.store(dsink_ptr + head * dsink_s1, {self.stored_as('dsink', '-tl.sum(dsink_acc, 0)')})")


BACKWARD_KERNELS = {"delta": BackwardWriter.delta_kernel, "dkdv": BackwardWriter.dkdv_kernel,
                    "dq": BackwardWriter.dq_kernel, "dbias": BackwardWriter.dbias_kernel,
                    "dsink": BackwardWriter.dsink_kernel}


def render_backward(kernel_name: str, which: str, spec: AttentionSpec, compute_type: str, description: str):
    """The KernelSource (name, source, arguments) of one of the backward kernels ("delta", "dkdv", "dq", "dbias") under
    `spec`."""
    writer = BackwardWriter(spec, compute_type)
    BACKWARD_KERNELS[which](writer)
    args = attention_arguments(spec, {}, [])
    return KernelSource(kernel_name, kernel_module(description, writer.emitter.globals, kernel_name, args,
                                                   "\n".join(writer.body) + "\n", libraries=("lib",),
                                                   helpers=writer.helper_texts(args)), args)
