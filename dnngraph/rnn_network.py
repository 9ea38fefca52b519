"""A torch-style recurrent network (nn.RNN / nn.LSTM / nn.GRU) written as graph ops.

Per layer and direction: the input projection of every time step is one GEMM (x @ w_ih^T + b_ih,
the bias fused in its epilogue) and the recurrence is one `rnn_recurrence` node (ops/rnn.py);
directions join along the feature axis, dropout (the dropout op, its counters advanced per
layer) runs between layers. Weights come in torch's `_flat_weights` order, so an nn.LSTM's
parameters bind directly: per layer, per direction, w_ih, w_hh, (b_ih, b_hh), (w_hr).

Every shape is checked before the first op is added: a refused call leaves the graph unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import ValidationError
from .ops.base import boolean, choice, integer, real
from .ops.dropout import DropoutAttrs, check_random_inputs
from .ops.rnn import FLOAT_TYPES, GATES, MODES, check_lengths
from .tensor import Tensor


@dataclass(frozen=True)
class RnnShape:
    """What the arguments of g.rnn say: extents, layer count, directions, weight slots."""
    mode: str
    steps: int
    batch: int
    input_size: int
    hidden: int
    state: int  # proj_size, or hidden
    layers: int
    directions: int
    bias: bool

    @property
    def per_direction(self) -> int:
        """Weights per (layer, direction): w_ih, w_hh, biases, the projection."""
        return 2 + 2 * self.bias + (self.state != self.hidden)


def _fail(message: str):
    raise ValidationError(f"rnn: {message}")


def _check_type(role: str, tensor):
    if tensor.data_type not in FLOAT_TYPES:
        _fail(f"{role} {tensor.name!r} is {tensor.data_type.name}; rnn takes float32, float16, bfloat16")


def _check(role: str, tensor, dims: tuple):
    _check_type(role, tensor)
    if tuple(tensor.dim) != tuple(dims):
        _fail(f"{role} {tensor.name!r} must be {list(dims)}, got {list(tensor.dim)}")


def rnn_shape(x, h0, c0, weights, mode, num_layers, bidirectional, proj_size, bias, batch_first) -> RnnShape:
    """Validate every argument of g.rnn (ValidationError naming the first bad one)."""
    mode = choice("rnn", "mode", mode, MODES)
    layers = integer("rnn", "num_layers", num_layers, minimum=1, maximum=1 << 16)
    directions = 2 if boolean("rnn", "bidirectional", bidirectional) else 1
    proj = integer("rnn", "proj_size", proj_size, minimum=0)
    bias = boolean("rnn", "bias", bias)
    if proj and mode != "lstm":
        _fail(f"proj_size is for lstm only, not {mode}")
    _check_type("x", x)
    if len(x.dim) != 3:
        _fail(f"x {x.name!r} must be [T, B, input] (or [B, T, input] with batch_first), got {list(x.dim)}")
    steps, batch, input_size = (int(d) for d in x.dim)
    if boolean("rnn", "batch_first", batch_first):
        steps, batch = batch, steps
    if not isinstance(weights, (list, tuple)) or not weights:
        _fail("weights must be a non-empty list in torch's _flat_weights order")
    first_hh = weights[1] if len(weights) > 1 else weights[0]
    if len(first_hh.dim) != 2 or first_hh.dim[0] % GATES[mode]:
        _fail(f"w_hh {first_hh.name!r} must be [{GATES[mode]} * hidden, state], got {list(first_hh.dim)}")
    hidden = int(first_hh.dim[0]) // GATES[mode]
    if proj and proj >= hidden:
        _fail(f"proj_size {proj} must be smaller than hidden {hidden}")
    shape = RnnShape(mode, steps, batch, input_size, hidden, proj or hidden, layers, directions, bias)
    expected = layers * directions * shape.per_direction
    if len(weights) != expected:
        _fail(f"{layers} layer(s) x {directions} direction(s) of {mode} take {expected} weights, got {len(weights)}")
    for layer in range(layers):
        width = input_size if layer == 0 else directions * shape.state
        for direction in range(directions):
            _check_slot(shape, _slot(shape, weights, layer, direction), width, f"layer {layer} direction {direction}")
    slots = layers * directions
    _check("h0", h0, (slots, batch, shape.state))
    if (c0 is not None) != (mode == "lstm"):
        _fail("c0 is required for lstm and taken by no other mode")
    if c0 is not None:
        _check("c0", c0, (slots, batch, hidden))
    if steps < 1 or batch < 1:
        _fail(f"x {list(x.dim)} needs at least one time step and one batch entry")
    return shape


def _slot(shape: RnnShape, weights, layer: int, direction: int) -> dict:
    """The weights of one (layer, direction) by name (absent ones None)."""
    start = (layer * shape.directions + direction) * shape.per_direction
    found = list(weights[start:start + shape.per_direction])
    slot = {"w_ih": found.pop(0), "w_hh": found.pop(0), "b_ih": None, "b_hh": None, "w_hr": None}
    if shape.bias:
        slot["b_ih"], slot["b_hh"] = found.pop(0), found.pop(0)
    if found:
        slot["w_hr"] = found.pop(0)
    return slot


def _check_slot(shape: RnnShape, slot: dict, width: int, where: str):
    rows = GATES[shape.mode] * shape.hidden
    _check(f"{where} w_ih", slot["w_ih"], (rows, width))
    _check(f"{where} w_hh", slot["w_hh"], (rows, shape.state))
    for name in ("b_ih", "b_hh"):
        if slot[name] is not None:
            _check(f"{where} {name}", slot[name], (rows,))
    if slot["w_hr"] is not None:
        _check(f"{where} w_hr", slot["w_hr"], (shape.state, shape.hidden))


def _dropout_args(dropout, seed, offset, layers: int, layer_numel: int):
    """p, after checking the seed and offset as the dropout ops will (before any op is added)."""
    p = real("rnn", "dropout", dropout)
    if not 0.0 <= p < 1.0:
        _fail(f"dropout must be in [0, 1), got {p}")
    if p == 0.0 or layers == 1:
        return 0.0
    if seed is None:
        _fail("dropout between layers needs dropout_seed (an int or an int64 tensor of one element)")
    seed_tensor, offset_tensor = (v if isinstance(v, Tensor) else None for v in (seed, offset))
    DropoutAttrs(p, None if seed_tensor is not None else seed, None if offset_tensor is not None else offset)
    check_random_inputs("rnn", None if seed_tensor is not None else seed,
                        None if offset_tensor is not None else offset, seed_tensor, offset_tensor)
    if offset_tensor is None:  # the last layer's shifted offset must stay an offset
        integer("rnn", "dropout_offset", offset, 0, 2**63 - 1 - (layers - 1) * layer_numel)
    return p


def build_rnn(g, x, h0, c0, weights, mode, num_layers, bidirectional, proj_size, dropout, dropout_seed,
              dropout_offset, seq_lengths, bias, batch_first, allow_tf32):
    """The ops of the network; returns (y, h_n, c_n) (c_n None but for lstm)."""
    x = g._check_input("rnn", "x", x)
    h0 = g._check_input("rnn", "h0", h0)
    c0 = None if c0 is None else g._check_input("rnn", "c0", c0)
    weights = [g._check_input("rnn", f"weights[{i}]", w) for i, w in enumerate(weights)] \
        if isinstance(weights, (list, tuple)) else weights
    shape = rnn_shape(x, h0, c0, weights, mode, num_layers, bidirectional, proj_size, bias, batch_first)
    if seq_lengths is not None:
        seq_lengths = g._check_input("rnn", "seq_lengths", seq_lengths)
        check_lengths("rnn", seq_lengths, shape.batch)
    p = _dropout_args(dropout, dropout_seed, dropout_offset, shape.layers,
                      shape.steps * shape.batch * shape.directions * shape.state)
    layer_input = g.transpose(x, [1, 0, 2]) if batch_first else x
    finals_h, finals_c = [], []
    for layer in range(shape.layers):
        if layer > 0 and p > 0.0:
            layer_input = _dropout(g, layer_input, p, dropout_seed, dropout_offset, layer - 1)
        outputs = []
        for direction in range(shape.directions):
            y, h_n, c_n = _direction(g, shape, layer_input, h0, c0, _slot(shape, weights, layer, direction),
                                     layer * shape.directions + direction, direction == 1, seq_lengths, allow_tf32)
            outputs.append(y)
            finals_h.append(h_n)
            finals_c.append(c_n)
        layer_input = outputs[0] if len(outputs) == 1 else g.concatenate(outputs, 2)
    y = g.transpose(layer_input, [1, 0, 2]) if batch_first else layer_input
    return y, _stacked(g, finals_h), (_stacked(g, finals_c) if c0 is not None else None)


def _direction(g, shape: RnnShape, layer_input, h0, c0, slot: dict, index: int, reverse: bool, lengths,
               allow_tf32):
    """The projection GEMM and the recurrence of one (layer, direction)."""
    xw = g.matmul(layer_input, g.transpose(slot["w_ih"], [1, 0]), allow_tf32=allow_tf32)
    if slot["b_ih"] is not None:
        xw = g.add(xw, slot["b_ih"])
    first_h = g.reshape(g.slice(h0, [(index, index + 1), slice(None), slice(None)]), [shape.batch, shape.state])
    first_c = None if c0 is None else \
        g.reshape(g.slice(c0, [(index, index + 1), slice(None), slice(None)]), [shape.batch, shape.hidden])
    y, h_n, c_n, *_ = g.rnn_recurrence(xw, first_h, first_c, slot["w_hh"], slot["b_hh"], slot["w_hr"], lengths,
                                       mode=shape.mode, reverse=reverse, allow_tf32=allow_tf32)
    return y, h_n, c_n


def _dropout(g, value, p: float, seed, offset, between: int):
    """Dropout of the input of layer `between + 1`: its counters start after the previous
    layers' (offset + between * numel), so no two layers draw the same mask."""
    numel = 1
    for size in value.dim:
        numel *= int(size)
    shift = between * numel
    if isinstance(offset, int):
        offset = offset + shift
    elif shift:
        offset = g.add(offset, shift)
    return g.dropout(value, p, seed, offset)


def _stacked(g, finals: list):
    """[B, S] states of every (layer, direction) as [layers * directions, B, S]."""
    rows = [g.reshape(state, [1] + [int(d) for d in state.dim]) for state in finals]
    return rows[0] if len(rows) == 1 else g.concatenate(rows, 0)
