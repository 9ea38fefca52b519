"""Ragged (THD) sdpa on CPU through the interpreter, against the float64 reference: sequences of
mixed lengths (0, 1 and the maximum among them) packed one after another in buffers with
trailing garbage tokens, q/o ragged with k/v ragged or dense, GQA, both causal alignments,
forward and backward; bad offsets raise a typed error and write nothing; serialization; the
sm_90 compile of the ragged kernels; GPU versions at realistic sizes (marked gpu)."""
import pytest
import torch

import dnngraph as dg
from dnngraph import ragged
from dnngraph.backends.triton.heuristics import sdpa as heur
from helpers import compiled_for_sm90

TYPES = {torch.float32: dg.float32, torch.float16: dg.float16, torch.bfloat16: dg.bfloat16}
GARBAGE = 3  # tokens past the last sequence of every packed buffer: never read into results nor written
TILE = heur.AttentionConfig(16, 16, 1, 1)
TILES = dg.BuildOptions(sdpa_config=TILE, sdpa_dkdv_config=TILE, sdpa_dq_config=TILE)


def thd(batch, heads, s_max, depth):
    """(dims, strides) of a ragged THD operand: token stride H * D, head stride D."""
    return [batch, heads, s_max, depth], [s_max * heads * depth, depth, heads * depth, 1]


def packed_view(buffer, dims, strides):
    return buffer.as_strided(dims, strides)


def buffer_for(lengths, heads, depth, dims, strides, fill):
    """A flat buffer holding the sequences packed (then GARBAGE tokens), at least as long as the
    view of the declared dims spans; `fill(n)` makes its n values."""
    span = sum((n - 1) * s for n, s in zip(dims, strides)) + 1
    used = (sum(lengths) + GARBAGE) * heads * depth
    return fill(max(span, used))


def offsets_of(lengths, heads, depth, dtype=torch.int32):
    """Element offsets of each sequence's start, then the end: [B + 1, 1, 1, 1]."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n * heads * depth)
    return torch.tensor(starts, dtype=dtype).view(-1, 1, 1, 1)


class RaggedCase:
    """A graph of sdpa (and sdpa_backward) over packed operands, its bindings, and what the
    kernels must leave unwritten."""

    def __init__(self, batch, heads, kv_heads, lens_q, lens_kv, depth=16, s_max_q=None, s_max_kv=None,
                 dtype=torch.float32, ragged_kv=True, backward=False, seed=0, offset_dtype=torch.int32,
                 device="cpu", **attrs):
        gen = torch.Generator().manual_seed(seed)
        s_q, s_kv = s_max_q or max(lens_q), s_max_kv or max(lens_kv)
        self.device, self.dtype = device, dtype
        g = self.graph = dg.Graph(name="ragged", io_data_type=TYPES[dtype], intermediate_data_type=dg.float32,
                                  compute_data_type=dg.float32)
        self.buffers, self.values, self.layouts = {}, {}, {}
        q_layout, kv_layout = thd(batch, heads, s_q, depth), thd(batch, kv_heads, s_kv, depth)
        if not ragged_kv:
            kv_layout = ([batch, kv_heads, s_kv, depth], None)
        self.lens = {"q": lens_q, "kv": lens_kv}

        def randn(n):
            return torch.randn(n, generator=gen).to(dtype)

        handles = {}
        for name, layout, lengths, heads_of in (("q", q_layout, lens_q, heads), ("k", kv_layout, lens_kv, kv_heads),
                                                ("v", kv_layout, lens_kv, kv_heads)):
            dims, strides = layout
            if strides is None:
                value = torch.randn(*dims, generator=gen).to(dtype)
            else:
                buffer = buffer_for(lengths, heads_of, depth, dims, strides, randn)
                value = packed_view(buffer, dims, strides)
            self.values[name] = value
            handles[name] = g.tensor(name=name, dim=dims, stride=list(value.stride()), data_type=TYPES[dtype])
        for name, lengths in (("seq_len_q", lens_q), ("seq_len_kv", lens_kv)):
            self.values[name] = torch.tensor(lengths, dtype=torch.int32).view(batch, 1, 1, 1)
            handles[name] = g.tensor_like(self.values[name], name)
        for name, heads_of, lengths, wanted in (("off_q", heads, lens_q, True),
                                                ("off_kv", kv_heads, lens_kv, ragged_kv)):
            if wanted:
                self.values[name] = offsets_of(lengths, heads_of, depth, offset_dtype)
                handles[name] = g.tensor_like(self.values[name], name)
        handles["q"].set_ragged_offset(handles["off_q"])
        if ragged_kv:
            handles["k"].set_ragged_offset(handles["off_kv"])
            handles["v"].set_ragged_offset(handles["off_kv"])
        lens = {"seq_len_q": handles["seq_len_q"], "seq_len_kv": handles["seq_len_kv"]}
        o, stats = g.sdpa(handles["q"], handles["k"], handles["v"], is_inference=False, **lens, **attrs)
        o.set_output(True).set_stride(q_layout[1]).set_ragged_offset(handles["off_q"])
        stats.set_output(True)
        self.outputs = {"o": (o, q_layout, lens_q, heads), "stats": (stats, None, None, None)}
        if backward:
            dims, strides = q_layout
            self.values["dO"] = packed_view(buffer_for(lens_q, heads, depth, dims, strides, randn), dims, strides)
            handles["dO"] = g.tensor(name="dO", dim=dims, stride=strides, data_type=TYPES[dtype])
            handles["dO"].set_ragged_offset(handles["off_q"])
            dq, dk, dv = g.sdpa_backward(handles["q"], handles["k"], handles["v"], o, handles["dO"], stats, **lens,
                                         **attrs)
            dq.set_output(True).set_stride(q_layout[1]).set_ragged_offset(handles["off_q"])
            self.outputs["dq"] = (dq, q_layout, lens_q, heads)
            for name, grad in (("dk", dk), ("dv", dv)):
                grad.set_output(True)
                if ragged_kv:
                    grad.set_stride(kv_layout[1]).set_ragged_offset(handles["off_kv"])
                self.outputs[name] = (grad, kv_layout if ragged_kv else None, lens_kv, kv_heads)
        self.handles = handles

    def bindings(self):
        return {self.handles[name]: value.to(self.device) for name, value in self.values.items()}

    def poisoned_outputs(self):
        """name -> (bound view, its whole buffer), every element NaN."""
        made = {}
        for name, (tensor, layout, lengths, heads) in self.outputs.items():
            if layout is None or layout[1] is None:
                value = torch.full(tensor.dim, float("nan"), dtype=tensor.data_type.torch_dtype)
                made[name] = (value.to(self.device), None)
                continue
            dims, strides = layout
            buffer = buffer_for(lengths, heads, dims[3], dims, strides,
                                lambda n: torch.full((n,), float("nan"), dtype=tensor.data_type.torch_dtype))
            buffer = buffer.to(self.device)
            made[name] = (packed_view(buffer, dims, strides), buffer)
        return made

    def run(self, options=None):
        self.graph.build(options=options)
        made = self.poisoned_outputs()
        bindings = self.bindings()
        self.graph.execute({**bindings, **{self.outputs[n][0]: v for n, (v, _) in made.items()}})
        return made

    def check(self, options=None, tolerance=None):
        """Every output against the reference: ragged ones unpacked through their offsets, and
        each ragged buffer NaN outside its sequences' rows (nothing written there)."""
        made = self.run(options)
        # on the case's device: at realistic sizes the float64 reference (an attention forward
        # and backward over 2048-long sequences) takes the GPU milliseconds and the CPU minutes
        refs = {name: ref.cpu() for name, ref in self.graph.reference(self.bindings()).items()}
        limit = tolerance or (1e-5 if self.dtype == torch.float32 else 2e-2)
        for name, (view, buffer) in made.items():
            tensor, layout, lengths, heads = self.outputs[name]
            view = view.cpu()
            if buffer is not None:
                offsets = self.values["off_q" if lengths is self.lens["q"] else "off_kv"]
                seq_len = torch.tensor(lengths).view(-1, 1, 1, 1)
                out = ragged.unpack(view, offsets, seq_len).double()
                written = torch.zeros(buffer.numel(), dtype=torch.bool)
                for b, n in enumerate(lengths):
                    start = int(offsets.view(-1)[b])
                    written[start:start + n * heads * layout[0][3]] = True
                flat = buffer.cpu()
                assert not torch.isnan(flat[written]).any(), f"{name}: a sequence row left unwritten"
                assert torch.isnan(flat[~written]).all(), f"{name}: written outside its sequences"
            else:
                out = view.double()
            ref = refs[tensor.name]
            if name == "stats":  # rows past len_q hold whatever the padded rows' log-sum-exp is
                rows = torch.arange(ref.shape[2]).view(1, 1, -1, 1) < self.values["seq_len_q"].long()
                out, ref = torch.where(rows, out, 0.0), torch.where(rows, ref, 0.0)
            same = (torch.isnan(out) & torch.isnan(ref)) | (out == ref)
            assert not torch.isnan(out[~same]).any(), f"{name}: NaN in output"
            scale = torch.where(torch.isfinite(ref), ref, 0.0).norm().item() or 1.0
            err = (out[~same] - ref[~same]).norm().item() / scale
            assert err < limit, f"{name}: relative error {err:.3g} >= {limit}"
        return made


MIXED = {"mixed": ([5, 0, 1, 9], [7, 0, 3, 11]), "one": ([1, 9, 0], [11, 1, 4])}
MASKS = {"none": {}, "causal": {"use_causal_mask": True}, "causal_bottom_right": {"use_causal_mask_bottom_right": True}}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("lengths", sorted(MIXED))
def test_forward_mixed_lengths(lengths, mask):
    lens_q, lens_kv = MIXED[lengths]
    RaggedCase(len(lens_q), 4, 2, lens_q, lens_kv, **MASKS[mask]).check()


@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right"])
def test_backward_mixed_lengths_gqa(mask):
    lens_q, lens_kv = MIXED["mixed"]
    RaggedCase(len(lens_q), 4, 2, lens_q, lens_kv, backward=True, **MASKS[mask]).check()


def test_tiled_forward_and_backward_with_a_declared_maximum_past_every_length():
    # query tiles of 16 over S_max 37: several per sequence, the last sequence at the maximum
    RaggedCase(3, 2, 1, [37, 0, 20], [45, 17, 1], s_max_q=37, s_max_kv=45, backward=True,
               use_causal_mask=True).check(TILES)


def test_dense_kv_with_ragged_q_and_int64_offsets():
    RaggedCase(3, 4, 4, [6, 1, 0], [9, 9, 9], ragged_kv=False, backward=True,
               offset_dtype=torch.int64).check()


@pytest.mark.parametrize("extra", ["window", "dropout", "decode"])
def test_with_a_band_dropout_and_one_query_per_sequence(extra):
    if extra == "decode":  # one new token per sequence over a ragged cache: the packed decode tile
        RaggedCase(4, 8, 2, [1, 1, 0, 1], [13, 1, 5, 0], backward=True).check()
        return
    attrs = {"window": {"use_causal_mask": True, "diagonal_band_left_bound": 3},
             "dropout": {"dropout": (0.25, 7, 3)}}[extra]
    RaggedCase(3, 4, 2, [8, 0, 5], [6, 9, 1], backward=True, **attrs).check()


def test_half_types_and_a_declared_maximum_past_the_longest():
    RaggedCase(2, 2, 2, [7, 3], [5, 12], s_max_q=9, s_max_kv=13, dtype=torch.float16, backward=True).check()


def test_the_reference_reads_through_the_offsets():
    case = RaggedCase(2, 2, 1, [3, 2], [4, 1])
    q = ragged.unpack(case.values["q"], case.values["off_q"], case.values["seq_len_q"])
    flat = case.values["q"].as_strided((5 * 2 * 16,), (1,))
    assert torch.equal(q[1, :, :2], flat[3 * 32:5 * 32].view(2, 2, 16).transpose(0, 1))
    assert torch.all(q[1, :, 2:] == 0)


BAD_OFFSETS = {
    "decreasing": lambda off: torch.tensor([0, 40, 20, 200]).to(off.dtype).view(-1, 1, 1, 1),
    "past the buffer": lambda off: off + 10**6,
    "overlapping the next sequence": lambda off: torch.cat([off[:1], off[1:] - 16]),
}


@pytest.mark.parametrize("bad", sorted(BAD_OFFSETS) + ["length past the maximum"])
def test_bad_offsets_raise_and_write_nothing(bad):
    case = RaggedCase(3, 2, 2, [5, 0, 4], [6, 2, 3], backward=True)
    case.graph.build()
    if bad == "length past the maximum":
        case.values["seq_len_q"] = torch.tensor([5, 0, 6], dtype=torch.int32).view(-1, 1, 1, 1)
    else:
        case.values["off_q"] = BAD_OFFSETS[bad](case.values["off_q"])
    made = case.poisoned_outputs()
    with pytest.raises(dg.ExecutionError):
        case.graph.execute({**case.bindings(), **{case.outputs[n][0]: v for n, (v, _) in made.items()}})
    for name, (view, buffer) in made.items():
        assert torch.isnan(buffer if buffer is not None else view).all(), f"{name} was written"
    with pytest.raises(dg.ExecutionError):
        case.graph.reference(case.bindings())


def test_offsets_are_checked_on_every_execute_of_one_binding_set():
    """The offsets are contents, not metadata: an execute repeating a binding set that was checked
    before (its fast path) still checks them, so offsets made bad in place raise and write nothing."""
    case = RaggedCase(3, 2, 2, [5, 0, 4], [6, 2, 3], backward=True)
    case.graph.build()
    made = case.poisoned_outputs()
    bindings = {**case.bindings(), **{case.outputs[n][0]: v for n, (v, _) in made.items()}}
    case.graph.execute(bindings)  # good offsets: checked in full, then remembered
    for name, (view, buffer) in made.items():
        (buffer if buffer is not None else view).fill_(float("nan"))
    offsets = case.values["off_q"]
    offsets.copy_(torch.cat([offsets[:1], offsets[1:] - 16]))  # the same tensor, bad contents
    with pytest.raises(dg.ExecutionError):
        case.graph.execute(bindings)
    for name, (view, buffer) in made.items():
        assert torch.isnan(buffer if buffer is not None else view).all(), f"{name} was written"


def test_set_ragged_offset_validates_and_changes_nothing_on_error():
    g = dg.Graph(name="bad", io_data_type=dg.float32)
    q = g.tensor(name="q", dim=[2, 2, 5, 16])
    k = g.tensor(name="k", dim=[2, 2, 5, 16])
    good = g.tensor(name="good", dim=[3, 1, 1, 1], data_type=dg.int32)
    for bad in (g.tensor(name="wrong_b", dim=[2, 1, 1, 1], data_type=dg.int32),
                g.tensor(name="floats", dim=[3, 1, 1, 1], data_type=dg.float32), "not a tensor"):
        with pytest.raises(dg.ValidationError):
            q.set_ragged_offset(bad)
        assert q.ragged_offset is None
    with pytest.raises(dg.ValidationError):  # a ragged q needs seq_len_q
        g.sdpa(q.set_ragged_offset(good), k, k)
    assert not g.nodes
    o, _ = g.sdpa(q, k, k, seq_len_q=g.tensor(name="len_q", dim=[2, 1, 1, 1], data_type=dg.int32))
    with pytest.raises(dg.ValidationError):  # k ragged without seq_len_kv: the node refuses
        k.set_ragged_offset(good)
    assert k.ragged_offset is None and o.producer.inputs[13] is None
    r = g.relu(o.set_output(True).set_ragged_offset(good))
    r.set_output(True)
    with pytest.raises(dg.ValidationError):  # relu would read the packed o densely
        g.validate()


def test_serialization_round_trip_keeps_the_offsets():
    case = RaggedCase(3, 2, 1, [4, 0, 1], [5, 2, 6], backward=True, use_causal_mask=True)
    g2 = dg.Graph.from_json(case.graph.to_json())
    renamed = {t.name: t for t in g2.tensors}
    assert renamed["q"].ragged_offset is renamed["off_q"]
    assert renamed[case.outputs["o"][0].name].ragged_offset is renamed["off_q"]
    assert renamed[case.outputs["dk"][0].name].ragged_offset is renamed["off_kv"]
    case.graph = g2
    case.handles = {name: renamed[name] for name in case.handles}
    case.outputs = {n: (renamed[t.name],) + tuple(rest) for n, (t, *rest) in case.outputs.items()}
    case.check()


def test_as_function_takes_packed_views_and_refuses_autograd():
    case = RaggedCase(3, 2, 2, [4, 0, 6], [5, 3, 1])
    g, values = case.graph, case.values
    names = ["q", "k", "v", "seq_len_q", "seq_len_kv", "off_q", "off_kv"]
    fn = g.as_function(inputs=names, outputs=[case.outputs["o"][0]])
    o = fn(*[values[name] for name in names])
    ref = g.reference(case.bindings())[case.outputs["o"][0].name]
    assert torch.allclose(ragged.unpack(o, values["off_q"], values["seq_len_q"]).double(), ref, atol=1e-5)
    with pytest.raises(dg.ExecutionError):  # a dense copy of q would lose its packing
        fn(values["q"].contiguous(), *[values[name] for name in names[1:]])
    q = values["q"].detach().clone().requires_grad_(True)
    with pytest.raises(dg.UnsupportedError):
        fn(q, *[values[name] for name in names[1:]])


def sm90_graphs():
    """A built ragged graph (forward, then delta, dK/dV and dQ) for the sm_90 compile check."""
    case = RaggedCase(3, 4, 2, [70, 0, 33], [90, 12, 1], depth=64, dtype=torch.bfloat16, backward=True,
                      use_causal_mask=True)
    case.graph.build()
    yield "ragged sdpa with backward", case.graph


def test_ragged_kernels_compile_for_sm90():
    assert "compiled 4 kernels for sm_90" in compiled_for_sm90("test_sdpa_ragged:sm90_graphs", timeout=400)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_ragged_at_realistic_sizes_gpu(mask, dtype):
    lens_q, lens_kv = [1024, 0, 1, 517, 2048], [1031, 7, 1, 2048, 2048]
    RaggedCase(5, 16, 4, lens_q, lens_kv, depth=128, dtype=dtype, backward=True, device="cuda",
               **MASKS[mask]).check()
    torch.cuda.synchronize()


def _two_node_graph(second_lengths: bool):
    """q, k, v ragged through one offset tensor, read by two sdpa nodes: with second_lengths the
    second node names other seq_len tensors than the first."""
    batch, heads, s_max, depth = 2, 1, 8, 16
    dims, strides = [batch, heads, s_max, depth], [s_max * heads * depth, depth, heads * depth, 1]
    g = dg.Graph(name="two_nodes", io_data_type=dg.float32)
    q, k, v = (g.tensor(name=n, dim=dims, stride=strides) for n in ("q", "k", "v"))
    offsets = g.tensor(name="offsets", dim=[batch + 1, 1, 1, 1], data_type=dg.int32)
    first = g.tensor(name="lengths_a", dim=[batch, 1, 1, 1], data_type=dg.int32)
    second = g.tensor(name="lengths_b", dim=[batch, 1, 1, 1], data_type=dg.int32) if second_lengths else first
    for t in (q, k, v):
        t.set_ragged_offset(offsets)
    g.sdpa(q, k, v, seq_len_q=first, seq_len_kv=first)[0].set_output(True)
    g.sdpa(q, k, v, seq_len_q=second, seq_len_kv=second)[0].set_output(True)
    return g


def test_one_ragged_tensor_takes_one_seq_len_tensor():
    """Execute checks a ragged tensor's offsets against one seq_len tensor: two sdpa nodes naming
    two for it are refused at validation (the second's lengths would go unchecked)."""
    _two_node_graph(second_lengths=False).validate()
    with pytest.raises(dg.ValidationError, match="one seq_len tensor"):
        _two_node_graph(second_lengths=True).validate()


def test_profile_checks_the_offsets_as_execute_does():
    case = RaggedCase(3, 2, 2, [5, 0, 4], [6, 2, 3])
    case.graph.build()
    case.values["off_q"] = BAD_OFFSETS["past the buffer"](case.values["off_q"])
    made = case.poisoned_outputs()
    bindings = {**case.bindings(), **{case.outputs[n][0]: v for n, (v, _) in made.items()}}
    with pytest.raises(dg.ExecutionError):
        case.graph.plan.profile(bindings)
    for name, (view, buffer) in made.items():
        assert torch.isnan(buffer if buffer is not None else view).all(), f"{name} was written"
