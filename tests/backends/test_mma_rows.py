"""No tensor-core dot of any family runs with warps replicated over rows its tile lacks.

Triton lays a dot tile on mma.sync with 16 rows per warp along M, and on Hopper's wgmma a
chain's head dot (q k^T) with every warp along M too (4 per 64 rows); a tile with fewer rows than
its warps cover is computed several times over, and the fp8 attention gave NaN rows on the H200
that way (2026-11-29). heuristics/mma.py holds the one rule every family's config obeys; here:
  - the rule's model of Triton's layouts and the configs of every family at small and odd
    shapes (fast, no compiler);
  - representative graphs of every family that emits tl.dot, built for the H200 and compiled
    for sm_90 in one process, counting replicated dots in the compiler's TTGIR
    (tests/sm90_compile.py's replicated_mma_dots), with a forced config that replicates as the
    control that the count can fail;
  - on a GPU, the same graphs against the float64 reference.
"""
import dataclasses
import json

import pytest
import torch

import dnngraph as dg
from dnngraph.backends.triton.heuristics import matmul as mm
from dnngraph.backends.triton.heuristics import sdpa as attention
from dnngraph.backends.triton.heuristics.mma import fitting_warps, has_wgmma, lone_dot_warps, replicates_rows
from dnngraph.backends.triton.heuristics.moe import schedule as moe_schedule
from dnngraph.backends.triton.lower.rnn import schedule_rnn
from helpers import check, compiled_for_sm90

H200 = dg.BuildOptions(target=dg.target.H200)
# a GPU without wgmma (an A100's capability on the H100's model): every dot on mma.sync
SM80 = dataclasses.replace(dg.target.H100, name="sm_80 model", capability=(8, 0))
SMALL = (1, 5, 16, 17, 21, 33, 40)
BF16_TOLERANCE = 1.6e-2


# --- the rule --------------------------------------------------------------------------------------
def test_lone_dot_layouts_balance_rows_and_columns():
    """The model of Triton 3.6's placement of a lone dot's warps (warpsPerTileV2); the compile
    test below holds it against every mma.sync dot the compiler laid out."""
    assert lone_dot_warps(16, 64, 4) == (1, 4)
    assert lone_dot_warps(16, 16, 4) == (2, 2)  # 32 rows of warps on 16: replicated
    assert lone_dot_warps(16, 16, 2) == (1, 2)


def test_fitting_warps_halves_until_the_rows_are_filled():
    assert fitting_warps(16, (16,), 4) == 2
    assert fitting_warps(16, (64,), 4) == 4
    assert fitting_warps(32, (64, 16), 4, chained=True) == 2  # the bf16 sdpa forward at 21x19x16
    assert fitting_warps(16, (64, 64), 4, chained=True) == 4  # decode: every warp along the keys
    assert fitting_warps(64, (256,), 8) == 8  # wgmma, a lone dot: [4, 2] warpgroups
    # wgmma, a chain's head dot (q k^T feeding P v): every warp along M, 128 rows of warps on 64
    assert fitting_warps(64, (64, 128), 8, chained=True) == 4
    assert fitting_warps(128, (64, 128), 8, chained=True) == 8
    assert fitting_warps(64, (64, 128), 8, chained=True, wgmma_head_copies=True) == 8  # the backward's choice
    assert fitting_warps(64, (64, 128), 8, chained=True, wgmma=False) == 4  # mma.sync: 16 rows a warp
    assert has_wgmma((9, 0)) and not has_wgmma((8, 0)) and not has_wgmma(None)
    assert not replicates_rows(128, (16,), 4)
    assert replicates_rows(32, (32, 32), 4, chained=True)


def _matmul_problems():
    for dot in ("bf16", "fp16", "fp8", "int8", "tf32"):
        size = 1 if dot in ("fp8", "int8") else 2 if dot in ("bf16", "fp16") else 4
        for m in SMALL:
            for n in SMALL:
                for k in (1, 9, 40):
                    yield mm.MatmulProblem(1, m, n, k, dot, size, size, 2, False, "row", "row")


@pytest.mark.parametrize("target", [dg.target.H100, dg.target.H200, SM80], ids=["H100", "H200", "sm80"])
def test_matmul_and_conv_candidates_fill_their_warps(target):
    """Every candidate the matmul model ranks (conv and wgrad draw on the same ones) at small and
    odd M, N, K, for every tensor-core dot type."""
    for problem in _matmul_problems():
        for config in mm.candidates(problem, target):
            assert not replicates_rows(config.block_m, (config.block_n,), config.num_warps,
                                       wgmma=has_wgmma(target.capability)), \
                (problem.signature(), config.text)


def _attention_problems():
    # 64 and 100 query rows: a 128-row table tile shrunk to 64 (a wgmma head dot's rows)
    for s_q in SMALL + (64, 100):
        for s_kv in SMALL:
            for d, dv in ((16, 16), (64, 64), (32, 64), (128, 128), (256, 256)):
                for heads, kv_heads in ((2, 2), (4, 1)):
                    for element_bytes in (2, 4):
                        yield attention.AttentionProblem(1, heads, kv_heads, s_q, s_kv, d, dv, element_bytes,
                                                         s_q % 2 == 0, causal=s_q % 2 == 0)


@pytest.mark.parametrize("target", [dg.target.H100, dg.target.H200, SM80], ids=["H100", "H200", "sm80"])
def test_attention_configs_fill_their_warps(target):
    """Forward (table, decode, op-level chain) and backward (dK/dV rows are keys, dQ rows
    queries) configs at short odd sequences: their chained dots fill every warp's rows (without
    wgmma, 64-row tiles too)."""
    wgmma = has_wgmma(target.capability)

    def fills(rows, cols, num_warps, accumulators):
        """No warp replicated, but for a wgmma head dot's copies where halving would crowd the
        registers with the accumulators (sdpa._accumulators_crowd)."""
        copies = attention._accumulators_crowd(rows, accumulators, num_warps)
        return not replicates_rows(rows, cols, num_warps, True, wgmma, wgmma_head_copies=copies)
    for problem in _attention_problems():
        forward = attention.schedule(problem, target)
        c, dv = forward.config, (forward.block_dv,)
        assert fills(c.block_m, (c.block_n,) + dv, c.num_warps, dv), (problem, forward.config_text)
        chain = attention.chain_schedule(problem, target).config
        assert fills(chain.block_m, (chain.block_n,) + dv, chain.num_warps, dv), problem
        backward = attention.backward_schedule(problem, target)
        widths = (backward.block_d, backward.block_dv)
        dkdv, dq = backward.configs["dkdv"], backward.configs["dq"]
        assert fills(dkdv.block_n, (dkdv.block_m,) + widths, dkdv.num_warps, widths), problem
        assert fills(dq.block_m, (dq.block_n,) + widths, dq.num_warps, widths[:1]), problem


def test_wgmma_head_copies_only_where_halving_crowds_registers():
    """At 64 query rows on the H200 a 128-row table tile on 8 warps halves to 4 (its q k^T dot
    no longer computed twice) up to D 128; at D 256 a [64, 256] fp32 accumulator on 4 warps
    spilled (ptxas), so the 8 warps and the head dot's copies stay (mma.sync's copies, which
    gave NaN, are never kept: test_attention_configs_fill_their_warps on sm80)."""
    problem = lambda d: attention.AttentionProblem(1, 2, 2, 64, 256, d, d, 2, False)
    for d, warps in ((64, 4), (128, 4), (256, 8)):
        assert attention.schedule(problem(d), dg.target.H200).config.num_warps == warps, d
    assert attention.backward_schedule(problem(256), dg.target.H200).configs["dkdv"].num_warps == 8


def test_forced_attention_configs_run_as_given():
    """BuildOptions' sdpa configs keep their warps (as forced matmul configs do: a forced config
    is what a sweep measures), but for a forward tile the short query rows cut, which the rule
    then fits."""
    config = attention.AttentionConfig
    problem = lambda s_q, d: attention.AttentionProblem(1, 2, 2, s_q, s_q, d, d, 2, False)
    forced = attention.ForcedAttention(forward=config(64, 64, 8, 3), dq=config(32, 16, 4, 1))
    assert attention.schedule(problem(64, 64), dg.target.H200, forced=forced).config == config(64, 64, 8, 3)
    assert attention.backward_schedule(problem(64, 16), dg.target.H200, forced=forced).configs["dq"] == \
        config(32, 16, 4, 1)
    cut = attention.ForcedAttention(forward=config(64, 16, 4, 3))
    assert attention.schedule(problem(21, 16), dg.target.H200, forced=cut).config == config(32, 16, 2, 3)
    # not forced, the same tiles fill their warps
    assert attention.schedule(problem(64, 64), dg.target.H200).config.num_warps == 4


def test_moe_and_rnn_configs_fill_their_warps():
    from types import SimpleNamespace
    for rows in SMALL:
        for n in SMALL:
            for op in ("moe_grouped_matmul", "moe_grouped_matmul_wgrad"):
                config = moe_schedule(op, rows, 24, n, 3, False)
                dot_rows = config.block_m if op == "moe_grouped_matmul" else config.block_k
                assert not replicates_rows(dot_rows, (config.block_n,), config.num_warps), (op, rows, n, config)
    for batch in SMALL:
        for hidden in SMALL:
            for op in ("rnn_recurrence", "rnn_recurrence_backward"):
                geometry = SimpleNamespace(op=op, batch=batch, hidden=hidden, state=hidden, gates=4)
                s = schedule_rnn(geometry, False)
                for chained in (False, True):
                    assert not replicates_rows(s.block_b, (s.block_h, s.block_k), s.num_warps, chained), (s, chained)


# --- representative graphs --------------------------------------------------------------------------
def _graph(dtype=dg.bfloat16, allow_tf32=False):
    return dg.Graph(name="mma_rows", io_data_type=dtype, intermediate_data_type=dg.float32,
                    compute_data_type=dg.float32, allow_tf32=allow_tf32)


def _matmul(m, n, k, dtype, out_type=None, batch=(), allow_tf32=False):
    g = _graph(dg.bfloat16 if out_type is None else out_type, allow_tf32)
    a = g.tensor(name="a", dim=list(batch) + [m, k], data_type=dtype)
    b = g.tensor(name="b", dim=list(batch) + [k, n], data_type=dtype)
    c = g.matmul(a, b).set_output(True).set_name("c")
    c.set_data_type(out_type or dtype)
    return g, {}


def _conv(direction):
    g = _graph()
    x_dim, w_dim, dy_dim = [1, 3, 9, 9], [5, 3, 3, 3], [1, 5, 4, 4]
    window = dict(padding=[0, 0], stride=[2, 2], dilation=[1, 1])
    if direction == "fprop":
        y = g.conv_fprop(g.tensor(name="x", dim=x_dim), g.tensor(name="w", dim=w_dim), **window)
    elif direction == "dgrad":
        y = g.conv_dgrad(g.tensor(name="dy", dim=dy_dim), g.tensor(name="w", dim=w_dim), x_dim, **window)
    else:
        y = g.conv_wgrad(g.tensor(name="dy", dim=dy_dim), g.tensor(name="x", dim=x_dim), w_dim, **window)
    y.set_output(True).set_name("y")
    return g, {}


def _sdpa(s_q, s_kv, d, dv, heads, kv_heads, dtype=dg.bfloat16, backward=False, allow_tf32=False):
    """The forward (o, stats), and with `backward` its gradients in the same graph (o and the
    stats the backward reads are the forward's)."""
    g = _graph(dtype, allow_tf32)
    q = g.tensor(name="q", dim=[1, heads, s_q, d])
    k, v = g.tensor(name="k", dim=[1, kv_heads, s_kv, d]), g.tensor(name="v", dim=[1, kv_heads, s_kv, dv])
    o, stats = g.sdpa(q, k, v, is_inference=False, use_causal_mask=True)
    o.set_output(True).set_name("o")
    stats.set_output(True).set_name("stats")
    if backward:
        d_o = g.tensor(name="d_o", dim=[1, heads, s_q, dv])
        for grad, name in zip(g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True), ("dq", "dk", "dv")):
            grad.set_output(True).set_name(name)
    return g, {}


def _paged_decode():
    """Decode (one query row, 4 query heads per K/V head) over 8-key pages."""
    pages, page_size, per_sequence = 6, 8, 3
    g = _graph()
    q = g.tensor(name="q", dim=[2, 4, 1, 32])
    k, v = (g.tensor(name=name, dim=[pages, 1, page_size, 32]) for name in ("k", "v"))
    tables = [g.tensor(name=name, dim=[2, 1, per_sequence, 1], data_type=dg.int32) for name in ("kt", "vt")]
    lengths = g.tensor(name="lens", dim=[2, 1, 1, 1], data_type=dg.int32)
    o, _ = g.sdpa(q, k, v, seq_len_kv=lengths, paged_attention_k_table=tables[0], paged_attention_v_table=tables[1])
    o.set_output(True).set_name("o")
    table = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32).view(2, 1, per_sequence, 1)
    return g, {"kt": table, "vt": table.clone(), "lens": torch.tensor([19, 7], dtype=torch.int32).view(2, 1, 1, 1)}


def _attention_ops():
    """Attention written as ops (the op-level chain kernel)."""
    g = _graph()
    q, kt = g.tensor(name="q", dim=[1, 2, 21, 16]), g.tensor(name="kt", dim=[1, 2, 16, 19])
    v = g.tensor(name="v", dim=[1, 2, 19, 16])
    g.matmul(g.softmax(g.matmul(q, kt)), v).set_output(True).set_name("o")
    return g, {}


def _moe(wgrad):
    g = _graph()
    rows, k, n = 5, 24, 17
    offsets = g.tensor(name="off", dim=[3], data_type=dg.int32)
    if wgrad:
        y = g.moe_grouped_matmul_wgrad(g.tensor(name="tok", dim=[rows, k]), g.tensor(name="dy", dim=[rows, n]), offsets)
    else:
        y = g.moe_grouped_matmul(g.tensor(name="tok", dim=[rows, k]), g.tensor(name="w", dim=[3, k, n]), offsets)
    y.set_output(True).set_name("y")
    return g, {"off": torch.tensor([0, 2, 2], dtype=torch.int32)}


def _rnn(mode, hidden, proj):
    """A recurrence and its backward (bf16), as as_function's graphs hold them."""
    gates = {"lstm": 4, "gru": 3}.get(mode, 1)
    state = proj or hidden
    g = _graph()
    xw = g.tensor(name="xw", dim=[5, 3, gates * hidden])
    h0, w_hh = g.tensor(name="h0", dim=[3, state]), g.tensor(name="w_hh", dim=[gates * hidden, state])
    c0 = g.tensor(name="c0", dim=[3, hidden]) if mode == "lstm" else None
    w_hr = g.tensor(name="w_hr", dim=[proj, hidden]) if proj else None
    y, h_n, c_n, h_prev, c_prev, _ = g.rnn_recurrence(xw, h0, c0, w_hh, None, w_hr, None, mode=mode)
    dy = g.tensor(name="dy", dim=[5, 3, state])
    grads = g.rnn_recurrence_backward(xw, w_hh, None, w_hr, None, h_prev, c_prev, dy, h_n, c_n, mode=mode)
    for index, tensor in enumerate([y] + [t for t in grads if t is not None]):
        tensor.set_output(True).set_name(f"out{index}")
    return g, {}


E4M3 = dg.float8_e4m3
# label -> (graph and fixed inputs, relative error allowed against float64 on the GPU). The
# labels marked * replicated warps before the rule (sm_90 compile, 2026-11-29).
CASES = {
    "matmul bf16 17x1x9 *": (lambda: _matmul(17, 1, 9, dg.bfloat16), BF16_TOLERANCE),
    "matmul tf32 33x5x40 *": (lambda: _matmul(33, 5, 40, dg.float32, allow_tf32=True), 5e-3),
    "matmul int8 5x17x40": (lambda: _matmul(5, 17, 40, dg.int8, dg.int32), 1e-12),
    "matmul fp8 21x1x40": (lambda: _matmul(21, 1, 40, E4M3, dg.bfloat16), BF16_TOLERANCE),
    "batched matmul bf16 3x21x19x16": (lambda: _matmul(21, 19, 16, dg.bfloat16, batch=(3,)), BF16_TOLERANCE),
    "conv fprop 1x3x9x9 *": (lambda: _conv("fprop"), BF16_TOLERANCE),
    "conv dgrad 1x3x9x9": (lambda: _conv("dgrad"), BF16_TOLERANCE),
    "conv wgrad 1x3x9x9": (lambda: _conv("wgrad"), BF16_TOLERANCE),
    "sdpa bf16 21x19x16 *": (lambda: _sdpa(21, 19, 16, 16, 2, 2), BF16_TOLERANCE),
    "sdpa fp16 backward 21x19x16 *": (lambda: _sdpa(21, 19, 16, 16, 2, 2, dg.float16, backward=True), 1e-2),
    "sdpa tf32 backward 21x19x16": (lambda: _sdpa(21, 19, 16, 16, 2, 2, dg.float32, True, True), 1e-2),
    "sdpa bf16 GQA d_qk 32 d_v 64 backward 33x5": (lambda: _sdpa(33, 5, 32, 64, 4, 2, backward=True), 3e-2),
    # a 128-row table tile shrunk to 64 query rows on 8 warps: wgmma laid its q k^T dot on [8, 1]
    "sdpa bf16 causal 64x64x128 *": (lambda: _sdpa(64, 64, 128, 128, 1, 1), BF16_TOLERANCE),
    "sdpa bf16 decode GQA 1x40x64": (lambda: _sdpa(1, 40, 64, 64, 4, 1), BF16_TOLERANCE),
    "sdpa bf16 paged decode": (_paged_decode, BF16_TOLERANCE),
    "attention ops bf16 21x19x16": (_attention_ops, BF16_TOLERANCE),
    "moe bf16 5x24x17": (lambda: _moe(False), BF16_TOLERANCE),
    "moe wgrad bf16 5x24x17": (lambda: _moe(True), BF16_TOLERANCE),
    "rnn gru H13 bf16": (lambda: _rnn("gru", 13, 0), 3e-2),
    "rnn lstm H40 P17 bf16": (lambda: _rnn("lstm", 40, 17), 3e-2),
}
# a config forced past the rule (BuildOptions runs it as given): the compile count must see it
CONTROL = "control: matmul bf16 17x1x9 forced 16x16 on 4 warps"
CONTROL_CONFIG = mm.MatmulConfig("small_m", 16, 16, 16, 4, 4)


def sm90_graphs():
    """Every case built for the H200, then the control, for tests/sm90_compile.py."""
    for label, (make, _) in CASES.items():
        yield label, make()[0].build(options=H200)
    g, _ = _matmul(17, 1, 9, dg.bfloat16)
    yield CONTROL, g.build(options=dg.BuildOptions(target=dg.target.H200, matmul_config=CONTROL_CONFIG))


# cases whose kernels hold lone dots (each laid out by itself) and chained ones (attention)
LONE_DOTS = ("matmul", "batched", "conv", "moe", "control")
CHAINED_DOTS = ("sdpa", "attention")


def _check_layouts(lines: list):
    """Each mma.sync dot's warp placement as heuristics/mma.py models it: a lone dot's exactly
    (lone_dot_warps), a chained one's all along M or all along N."""
    for line in lines:
        head, layout = line.rsplit(": ", 1)
        rows, cols, along_m, along_n, num_warps = json.loads(layout)
        label = head[len("mma_layout "):]
        if label.startswith(LONE_DOTS):
            assert lone_dot_warps(rows, cols, num_warps) == (along_m, along_n), line
        elif label.startswith(CHAINED_DOTS):
            assert (along_m, along_n) in ((num_warps, 1), (1, num_warps)), line


def test_small_shapes_compile_without_replicated_mma():
    """Every kernel of every case compiles for sm_90 with no mma.sync or wgmma dot replicated over rows,
    its dots laid out as the rule's model says; the control's forced 16x16 tile on 4 warps is
    counted (the count can fail)."""
    output = compiled_for_sm90("test_mma_rows:sm90_graphs", timeout=900, env={"SM90_MMA_ROWS": "1"})
    lines = output.splitlines()
    counts = [line for line in lines if line.startswith("mma_replicated ")]
    control = [line for line in counts if line.startswith(f"mma_replicated {CONTROL} ")]
    assert len(control) == 1 and not control[0].endswith(": 0"), control
    labels = {label for label in CASES if any(line.startswith(f"mma_replicated {label} ") for line in counts)}
    assert labels == set(CASES), set(CASES) - labels
    replicated = [line for line in counts if line not in control and not line.endswith(": 0")]
    assert not replicated, replicated
    # nor on wgmma: the forward's head dot (q k^T) on every warp of a tile shrunk to 64 rows
    on_wgmma = [line for line in lines if line.startswith("wgmma_replicated ")]
    assert any(line.startswith("wgmma_replicated sdpa bf16 causal 64x64x128") for line in on_wgmma)
    assert not [line for line in on_wgmma if not line.endswith(": 0")]
    layouts = [line for line in lines if line.startswith("mma_layout ")]
    assert any(line.startswith(f"mma_layout {CONTROL} ") for line in layouts)
    _check_layouts(layouts)


def test_replicated_count_reads_wgmma_dots():
    """The compile count sees wgmma (version 3, ttng.warp_group_dot) layouts as well as mma.sync's:
    the TTGIR lines of the sdpa forward at 64 query rows on 8 warps before the rule, and on 4,
    counted apart from mma.sync's."""
    from sm90_compile import replicated_mma_dots
    def ttgir(warps_along_m):
        return (f"#mma = #ttg.nvidia_mma<{{versionMajor = 3, versionMinor = 0, warpsPerCTA = [{warps_along_m}, 1], "
                "instrShape = [16, 32, 16]}>\n"
                "    %s = ttng.warp_group_dot %q, %k, %cst {inputPrecision = 0 : i32, isAsync = true} : "
                "!ttg.memdesc<64x64xbf16, #shared, #smem> * !ttg.memdesc<64x64xbf16, #shared1, #smem, mutable> "
                "-> tensor<64x64xf32, #mma> loc(#loc1)\n")
    assert replicated_mma_dots(ttgir(8), version=3) == 1
    assert replicated_mma_dots(ttgir(4), version=3) == 0
    assert replicated_mma_dots(ttgir(8)) == 0  # mma.sync's count: no version 2 layout here


# --- GPU: the same graphs against float64 -------------------------------------------------------------
def _inputs(g, fixed: dict, device: str) -> dict:
    """Fresh random values for every input the case does not fix (int8 small integers, fp8
    through its own rounding)."""
    generator = torch.Generator().manual_seed(7)
    values = {}
    for tensor in g.inputs():
        if tensor.name in fixed:
            values[tensor.name] = fixed[tensor.name].to(device)
            continue
        torch_type = tensor.data_type.torch_dtype
        if torch_type == torch.int8:
            value = torch.randint(-8, 8, tuple(tensor.dim), generator=generator, dtype=torch.int8)
        else:
            value = (torch.randn(tuple(tensor.dim), generator=generator) * 0.5).to(torch_type)
        values[tensor.name] = value.to(device)
    return values


@pytest.mark.gpu
@pytest.mark.parametrize("label", list(CASES))
def test_gpu_small_shapes_match_float64(label):
    """Each case on the GPU (its target: the H100's or H200's tiles) against the float64
    reference, outputs poisoned first."""
    make, tolerance = CASES[label]
    g, fixed = make()
    check(g, _inputs(g, fixed, "cuda"), device="cuda", tolerance=tolerance)
