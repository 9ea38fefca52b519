"""Recurrent family: the time recurrence of one RNN layer in one direction, and its backward.

`g.rnn` (graph.py) builds a whole torch-style recurrent network (layers, directions, dropout
between layers) from these ops plus matmuls: each layer's input projection of every time step is
one GEMM (`xw = x @ w_ih^T + b_ih`, the matmul family), and `rnn_recurrence` runs the steps.

`rnn_recurrence(xw, h0, c0, w_hh, b_hh, w_hr, seq_lengths)`, time-major:
  xw [T, B, G*H] the input projection (G gates: 1 for rnn_tanh/rnn_relu, 4 for lstm in torch's
  order i, f, g, o, 3 for gru in order r, z, n); h0 [B, P] with P = proj_size or H; c0 [B, H]
  (lstm); w_hh [G*H, P] and b_hh [G*H] as torch's weight_hh/bias_hh; w_hr [P, H] (lstm with a
  projection); seq_lengths [B] int32/int64 in [0, T].
  Steps, for each batch entry b with length L (T without seq_lengths): step k = 0..L-1 reads time
  t = k (forward) or t = L-1-k (reverse). rnn: h = act(xw_t + w_hh h + b_hh); lstm: torch's
  cell, h = (o * tanh(c)) @ w_hr^T with a projection; gru: n = tanh(xw_n + r * (w_hn h + b_hn)),
  h = (1 - z) n + z h. Times t >= L leave the state unchanged and give y[t] = 0 (torch's packed
  sequences padded back).
  Outputs: y [T, B, P]; h_n [B, P]; c_n [B, H] (lstm); and what the backward reads, float32 and
  indexed by time: h_prev [T, B, P] the state each time step starts from, c_prev [T, B, H] (lstm)
  likewise, h_raw [T, B, H] (lstm with a projection) o * tanh(c) before the projection; all three
  are 0 at t >= L.

`rnn_recurrence_backward(xw, w_hh, b_hh, w_hr, seq_lengths, h_prev, c_prev, dy, dh_n, dc_n)` runs
the steps in reverse and gives dxw [T, B, G*H] (the gradient of the gate pre-activations), dhh
(gru only: the gradient of w_hh h + b_hh, which differs from dxw on the n gate), dh0, dc0 (lstm)
and d_proj [T, B, P] (with a projection: the gradient of each step's projected output). The
weight gradients are then one GEMM over all steps each: dw_hh = dhh^T h_prev, dw_hr = d_proj^T
h_raw (rows past a sequence's length are 0 on both sides), db_hh their sum over (T, B).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dtypes
from ..errors import UnsupportedError
from .base import OpDef, OutputSpec, backward_rule, boolean, choice, fail, freeze, register
from ..tensor import contiguous_strides

MODES = ("rnn_tanh", "rnn_relu", "lstm", "gru")
GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}
FLOAT_TYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16)
LENGTH_TYPES = (dtypes.int32, dtypes.int64)


@dataclass(frozen=True)
class RnnRecurrenceAttrs:
    mode: str
    reverse: bool = False
    allow_tf32: bool = False  # fp32 weights: IEEE math unless the graph opts in

    def __post_init__(self):
        freeze(self, mode=choice("rnn_recurrence", "mode", self.mode, MODES),
               reverse=boolean("rnn_recurrence", "reverse", self.reverse),
               allow_tf32=boolean("rnn_recurrence", "allow_tf32", self.allow_tf32))

    @property
    def gates(self) -> int:
        return GATES[self.mode]


@dataclass(frozen=True)
class RnnSizes:
    """The extents of one recurrence: time, batch, hidden (the cell), projected state, gates."""
    steps: int
    batch: int
    hidden: int
    state: int
    gates: int


def _dims(op: str, role: str, tensor, rank: int) -> tuple:
    if tensor.data_type not in FLOAT_TYPES and tensor.producer is None:
        fail(op, f"{role} {tensor.name!r} is {tensor.data_type.name}; {op} takes "
                 f"{', '.join(t.name for t in FLOAT_TYPES)}")
    if len(tensor.dim) != rank:
        fail(op, f"{role} {tensor.name!r} must have rank {rank}, got {list(tensor.dim)}")
    return tuple(int(d) for d in tensor.dim)


def _expect(op: str, role: str, tensor, dims: tuple):
    if tensor is not None and _dims(op, role, tensor, len(dims)) != dims:
        fail(op, f"{role} {tensor.name!r} must be {list(dims)}, got {list(tensor.dim)}")


def check_lengths(op: str, lengths, batch: int):
    if lengths is None:
        return
    if lengths.data_type not in LENGTH_TYPES:
        fail(op, f"seq_lengths {lengths.name!r} must be int32 or int64, got {lengths.data_type.name}")
    if tuple(lengths.dim) != (batch,):
        fail(op, f"seq_lengths {lengths.name!r} must be [{batch}], got {list(lengths.dim)}")


def recurrence_sizes(op: str, attrs, xw, w_hh, w_hr) -> RnnSizes:
    """T, B, H, P and G from xw [T, B, G*H], w_hh [G*H, P] and w_hr [P, H]; checks they agree."""
    steps, batch, width = _dims(op, "xw", xw, 3)
    gates = attrs.gates
    if width % gates or width == 0:
        fail(op, f"xw {list(xw.dim)}: its last axis must be {gates} (gates of {attrs.mode}) x hidden")
    hidden = width // gates
    if steps < 1 or batch < 1:
        fail(op, f"xw {list(xw.dim)} needs at least one time step and one batch entry")
    rows, state = _dims(op, "w_hh", w_hh, 2)
    if rows != width:
        fail(op, f"w_hh {list(w_hh.dim)} must have {width} rows (the gates of xw)")
    if w_hr is not None:
        if attrs.mode != "lstm":
            fail(op, f"a projection (w_hr) is for lstm only, not {attrs.mode}")
        _expect(op, "w_hr", w_hr, (state, hidden))
        if state >= hidden:
            fail(op, f"proj_size {state} must be smaller than hidden {hidden}")
    elif state != hidden:
        fail(op, f"w_hh {list(w_hh.dim)} must have {hidden} columns (hidden), or a projection w_hr")
    return RnnSizes(steps, batch, hidden, state, gates)


def _out(dims, data_type=None) -> OutputSpec:
    return OutputSpec(tuple(dims), data_type, stride=contiguous_strides(tuple(dims)))


def infer(inputs, attrs: RnnRecurrenceAttrs):
    xw, h0, c0, w_hh, b_hh, w_hr, lengths = inputs
    op = "rnn_recurrence"
    s = recurrence_sizes(op, attrs, xw, w_hh, w_hr)
    _expect(op, "h0", h0, (s.batch, s.state))
    if (c0 is not None) != (attrs.mode == "lstm"):
        fail(op, "c0 is required for lstm and taken by no other mode")
    _expect(op, "c0", c0, (s.batch, s.hidden))
    _expect(op, "b_hh", b_hh, (s.gates * s.hidden,))
    check_lengths(op, lengths, s.batch)
    lstm = attrs.mode == "lstm"
    f32 = dtypes.float32
    return [_out((s.steps, s.batch, s.state)), _out((s.batch, s.state)),
            _out((s.batch, s.hidden)) if lstm else None,
            _out((s.steps, s.batch, s.state), f32),
            _out((s.steps, s.batch, s.hidden), f32) if lstm else None,
            _out((s.steps, s.batch, s.hidden), f32) if w_hr is not None else None]


def infer_backward(inputs, attrs: RnnRecurrenceAttrs):
    xw, w_hh, b_hh, w_hr, lengths, h_prev, c_prev, dy, dh_n, dc_n = inputs
    op = "rnn_recurrence_backward"
    s = recurrence_sizes(op, attrs, xw, w_hh, w_hr)
    check_lengths(op, lengths, s.batch)
    _expect(op, "b_hh", b_hh, (s.gates * s.hidden,))
    _expect(op, "h_prev", h_prev, (s.steps, s.batch, s.state))
    lstm = attrs.mode == "lstm"
    if (c_prev is not None) != lstm:
        fail(op, "c_prev is required for lstm and taken by no other mode")
    _expect(op, "c_prev", c_prev, (s.steps, s.batch, s.hidden))
    _expect(op, "dy", dy, (s.steps, s.batch, s.state))
    _expect(op, "dh_n", dh_n, (s.batch, s.state))
    if dc_n is not None and not lstm:
        fail(op, "dc_n is for lstm only")
    _expect(op, "dc_n", dc_n, (s.batch, s.hidden))
    width = s.gates * s.hidden
    return [_out((s.steps, s.batch, width)),
            _out((s.steps, s.batch, width)) if attrs.mode == "gru" else None,
            _out((s.batch, s.state)), _out((s.batch, s.hidden)) if lstm else None,
            _out((s.steps, s.batch, s.state)) if w_hr is not None else None]


# --- float64 reference: a loop over time ---------------------------------------------------------
def sequence_lengths(lengths, steps: int, batch: int) -> list:
    """Each entry's length (T without a lengths tensor); ValidationError outside [0, T]."""
    if lengths is None:
        return [steps] * batch
    values = [int(v) for v in lengths.reshape(-1).tolist()]
    for entry, value in enumerate(values):
        if not 0 <= value <= steps:
            fail("rnn_recurrence", f"seq_lengths[{entry}] = {value} is outside [0, {steps}]")
    return values


def time_index(step: int, length: int, reverse: bool) -> int:
    """The time step `step` of a sequence of `length` reads."""
    return length - 1 - step if reverse else step


def cell(mode: str, x_gates, hh_gates, c):
    """One step of one entry: (h before any projection, c) from the gate pre-activations of the
    input (xw_t) and of the state (w_hh h + b_hh)."""
    if mode == "lstm":
        i, f, g, o = (x_gates + hh_gates).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "gru":
        xr, xz, xn = x_gates.chunk(3, -1)
        hr, hz, hn = hh_gates.chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        return torch.tanh(xn + r * hn), c
    pre = x_gates + hh_gates
    return (torch.tanh(pre) if mode == "rnn_tanh" else torch.relu(pre)), c


def _run(xw, h0, c0, w_hh, b_hh, w_hr, lengths, attrs, taps=None):
    """The steps, entry by entry: [y, h_n, c_n, h_prev, c_prev, h_raw]. With `taps` (a list),
    each step appends (t, b, hh, out): its state pre-activation w_hh h + b_hh and its output,
    the tensors the backward's per-step gradients are taken at."""
    steps, batch, _ = xw.shape
    hidden = xw.shape[-1] // attrs.gates
    y = torch.zeros(steps, batch, h0.shape[-1], dtype=xw.dtype)
    h_prev = torch.zeros(steps, batch, h0.shape[-1], dtype=xw.dtype)
    c_prev = torch.zeros(steps, batch, hidden, dtype=xw.dtype) if c0 is not None else None
    h_raw = torch.zeros(steps, batch, hidden, dtype=xw.dtype) if w_hr is not None else None
    finals_h, finals_c = [], []
    for b, length in enumerate(sequence_lengths(lengths, steps, batch)):
        h, c = h0[b], None if c0 is None else c0[b]
        for step in range(length):
            t = time_index(step, length, attrs.reverse)
            h_prev[t, b] = h.detach()
            if c is not None:
                c_prev[t, b] = c.detach()
            hh = w_hh @ h + (b_hh if b_hh is not None else 0)
            new, c = cell(attrs.mode, xw[t, b], hh, c)
            if attrs.mode == "gru":
                z = torch.sigmoid(xw[t, b].chunk(3)[1] + hh.chunk(3)[1])
                new = (1 - z) * new + z * h
            if w_hr is not None:
                h_raw[t, b] = new.detach()
                new = w_hr @ new
            if taps is not None:
                taps.append((t, b, hh, new))
            y[t, b] = h = new
        finals_h.append(h)
        finals_c.append(c)
    h_n = torch.stack(finals_h)
    c_n = torch.stack(finals_c) if c0 is not None else None
    return [y, h_n, c_n, h_prev, c_prev, h_raw]


def reference(values, attrs: RnnRecurrenceAttrs):
    return _run(*values, attrs)


def reference_backward(values, attrs: RnnRecurrenceAttrs):
    """By autograd through the float64 steps, the per-step gradients taken at the tapped
    pre-activations and outputs."""
    xw, w_hh, b_hh, w_hr, lengths, h_prev, c_prev, dy, dh_n, dc_n = values
    steps, batch, width = xw.shape
    lens = sequence_lengths(lengths, steps, batch)
    # the state each sequence starts from is h_prev / c_prev at its first time step
    firsts = [time_index(0, n, attrs.reverse) if n else 0 for n in lens]
    leaf = (lambda v: v.detach().clone().requires_grad_(True))
    xw = leaf(xw)
    h0 = leaf(torch.stack([h_prev[t, b] for b, t in enumerate(firsts)]))
    c0 = None if c_prev is None else leaf(torch.stack([c_prev[t, b] for b, t in enumerate(firsts)]))
    taps = []
    y, h_n, c_n, *_ = _run(xw, h0, c0, w_hh, b_hh, w_hr, lengths, attrs, taps)
    pairs = [(o, g) for o, g in ((y, dy), (h_n, dh_n), (c_n, dc_n)) if o is not None and g is not None]
    wanted = [xw, h0] + ([c0] if c0 is not None else []) + [hh for *_, hh, _ in taps] + [out for *_, out in taps]
    found = list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True,
                                     materialize_grads=True))
    dxw, dh0 = found.pop(0), found.pop(0)
    dc0 = found.pop(0) if c0 is not None else None
    d_hh, d_out = found[:len(taps)], found[len(taps):]
    dhh = torch.zeros(steps, batch, width, dtype=xw.dtype) if attrs.mode == "gru" else None
    d_proj = torch.zeros(steps, batch, w_hr.shape[0], dtype=xw.dtype) if w_hr is not None else None
    for (t, b, _, _), grad_hh, grad_out in zip(taps, d_hh, d_out):
        if dhh is not None:
            dhh[t, b] = grad_hh
        if d_proj is not None:
            d_proj[t, b] = grad_out
    return [dxw, dhh, dh0, dc0, d_proj]


register(OpDef("rnn_recurrence", "rnn", "opaque", RnnRecurrenceAttrs,
               ("xw", "h0", "c0", "w_hh", "b_hh", "w_hr", "seq_lengths"),
               ("y", "h_n", "c_n", "h_prev", "c_prev", "h_raw"), infer, reference,
               optional=("c0", "b_hh", "w_hr", "seq_lengths")))
register(OpDef("rnn_recurrence_backward", "rnn", "opaque", RnnRecurrenceAttrs,
               ("xw", "w_hh", "b_hh", "w_hr", "seq_lengths", "h_prev", "c_prev", "dy", "dh_n", "dc_n"),
               ("dxw", "dhh", "dh0", "dc0", "d_proj"), infer_backward, reference_backward,
               optional=("b_hh", "w_hr", "seq_lengths", "c_prev", "dy", "dh_n", "dc_n")))


@backward_rule("rnn_recurrence")
def _rnn_recurrence_backward(d, node, grads):
    """The recurrence backward kernel, then each weight gradient as one GEMM over all steps."""
    xw, h0, c0, w_hh, b_hh, w_hr, lengths = node.inputs
    y, h_n, c_n, h_prev, c_prev, h_raw = node.outputs
    if any(g is not None for g in grads[3:]):
        raise UnsupportedError(f"node {node.name!r} (rnn_recurrence): no gradient through its saved states")
    dy, dh_n, dc_n = grads[:3]
    if dy is None and dh_n is None and dc_n is None:
        return [None] * 7
    g, attrs = d.graph, node.attrs
    value = (lambda t: None if t is None else d.value(t))
    dxw, dhh, dh0, dc0, d_proj = g.rnn_recurrence_backward(
        value(xw), value(w_hh), value(b_hh), value(w_hr), value(lengths), value(h_prev), value(c_prev), dy, dh_n,
        dc_n, mode=attrs.mode, reverse=attrs.reverse, allow_tf32=attrs.allow_tf32)
    dhh = dxw if dhh is None else dhh
    steps, batch, width = (int(v) for v in xw.dim)
    rows = steps * batch
    grad_w_hh = grad_b_hh = grad_w_hr = None
    if d.needs(w_hh):
        grad_w_hh = g.matmul(g.transpose(g.reshape(dhh, [rows, width]), [1, 0]),
                             g.reshape(value(h_prev), [rows, int(h_prev.dim[-1])]), allow_tf32=attrs.allow_tf32)
    if b_hh is not None and d.needs(b_hh):
        grad_b_hh = g.reshape(g.reduction(dhh, "sum", [0, 1]), [width])
    if w_hr is not None and d.needs(w_hr):
        grad_w_hr = g.matmul(g.transpose(g.reshape(d_proj, [rows, int(w_hr.dim[0])]), [1, 0]),
                             g.reshape(value(h_raw), [rows, int(w_hr.dim[1])]), allow_tf32=attrs.allow_tf32)
    return [dxw, dh0, dc0, grad_w_hh, grad_b_hh, grad_w_hr, None]


@backward_rule("rnn_recurrence_backward")
def _no_double_backward(d, node, grads):
    raise UnsupportedError(f"node {node.name!r} (rnn_recurrence_backward): no second derivative")
