"""CTC family: the connectionist temporal classification loss and its gradient.

`ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)`
follows torch's `F.ctc_loss` (the cuDNN frontend has no CTC graph op): log_probs [T, N, C] are
log-softmax'ed scores; targets are padded [N, S] or concatenated [sum of target lengths] class
ids; input_lengths and target_lengths [N] int32/int64 tensors. Each batch entry's loss is the
negative log of the summed probability of every alignment of its target to its first
input_length frames: the target extended with a blank before, between and after its labels
(length 2 * target_length + 1), a frame staying on its state, moving one state on, or skipping
the blank between two different labels (a repeated label needs a blank between). An input too
short for its target has no alignment: an infinite loss (zero_infinity makes it 0, and its
gradient 0). reduction "none" gives the [N] losses, "sum" their sum, "mean" the mean over the
batch of each loss divided by its target length clamped to 1 (both [1]). Its second output,
log_alpha [N, T, 2 * S + 1] float32 (S: the padded width, or the concatenated total; -inf past an
entry's frames and states), is stored only where something reads it: for padded targets the
backward rule hands it to the gradient, which then skips one of its two passes over the frames.

`ctc_loss_backward(log_probs, targets, input_lengths, target_lengths, grad_loss, log_alpha=None)`
gives
d log_probs [T, N, C] as torch (and cuDNN, warp-ctc) define it: for t < input_length,
(exp(log_probs[t, n, c]) - occupancy[t, n, c]) * g_n, where occupancy is the posterior
probability that frame t emits class c (the sum over the extended positions s labelled c of
exp(log_alpha[t, s] + log_beta[t, s] + nll - log_probs[t, c])), and 0 for t >= input_length.
The exact derivative of the loss with respect to log_probs is -occupancy * g_n; torch's value
adds exp(log_probs) * g_n, which makes it the derivative with respect to the logits of a
log_softmax, and changes nothing once it flows back through that log_softmax (each frame's
occupancies sum to 1, as its probabilities do). An infinite loss gives NaN there (0 with
zero_infinity), in every class of its first input_length frames, as in torch.

Lengths and labels are data, read by the kernels: the references raise ValidationError and
execute raises ExecutionError before any kernel runs where bound host values are out of range
(a length below 0 or past T / S, a concatenated total past the targets, a label outside
[0, C)). On the GPU they are never read back: the kernels clamp lengths into range and a label
outside [0, C) has probability 0 (an infinite loss), so nothing outside the tensors is read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import dtypes
from ..tensor import MAX_EXTENT
from .base import AnchorRule, OpDef, OutputSpec, backward_rule, boolean, choice, fail, freeze, integer, register

CTC_TYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16)
INDEX_TYPES = (dtypes.int32, dtypes.int64)
REDUCTIONS = ("none", "sum", "mean")


@dataclass(frozen=True)
class CtcLossAttrs:
    blank: int = 0
    reduction: str = "mean"
    zero_infinity: bool = False

    def __post_init__(self):
        freeze(self, blank=integer("ctc_loss", "blank", self.blank, minimum=0, maximum=MAX_EXTENT),
               reduction=choice("ctc_loss", "reduction", self.reduction, REDUCTIONS),
               zero_infinity=boolean("ctc_loss", "zero_infinity", self.zero_infinity))


def ctc_sizes(op: str, inputs, attrs: CtcLossAttrs) -> tuple:
    """(T, N, C) after checking every input's rank, extent and type."""
    log_probs, targets, input_lengths, target_lengths = inputs[:4]
    if len(log_probs.dim) != 3:
        fail(op, f"log_probs {log_probs.name!r} must be [T, N, C], got {list(log_probs.dim)}")
    if log_probs.producer is None and log_probs.data_type not in CTC_TYPES:
        fail(op, f"log_probs {log_probs.name!r} is {log_probs.data_type.name}; {op} takes "
                 f"{', '.join(t.name for t in CTC_TYPES)}")
    if not log_probs.data_type.is_floating:
        fail(op, f"log_probs {log_probs.name!r} must be floating, got {log_probs.data_type.name}")
    steps, batch, classes = (int(d) for d in log_probs.dim)
    if attrs.blank >= classes:
        fail(op, f"blank {attrs.blank} must be a class of log_probs (C={classes})")
    for role, tensor in (("targets", targets), ("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if tensor.data_type not in INDEX_TYPES:
            fail(op, f"{role} {tensor.name!r} must be int32 or int64, got {tensor.data_type.name}")
    if len(targets.dim) == 2 and int(targets.dim[0]) != batch:
        fail(op, f"padded targets {targets.name!r} {list(targets.dim)} must be [N={batch}, S]")
    if len(targets.dim) not in (1, 2):
        fail(op, f"targets {targets.name!r} must be padded [N, S] or concatenated [sum of lengths], "
                 f"got {list(targets.dim)}")
    for role, tensor in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if tuple(int(d) for d in tensor.dim) != (batch,):
            fail(op, f"{role} {tensor.name!r} must be [N={batch}], got {list(tensor.dim)}")
    return steps, batch, classes


def loss_dims(reduction: str, batch: int) -> tuple:
    return (batch,) if reduction == "none" else (1,)


def alpha_dims(inputs, steps: int, batch: int) -> tuple:
    """log_alpha's dims: [N, T, 2 * S + 1], S what one entry's labels may take at most (the
    padded width, or the concatenated total)."""
    targets = inputs[1]
    width = int(targets.dim[-1])
    return (batch, steps, 2 * width + 1)


def infer(inputs, attrs: CtcLossAttrs):
    steps, batch, classes = ctc_sizes("ctc_loss", inputs, attrs)
    return [OutputSpec(loss_dims(attrs.reduction, batch)),
            OutputSpec(alpha_dims(inputs, steps, batch), dtypes.float32)]


def infer_backward(inputs, attrs: CtcLossAttrs):
    steps, batch, classes = ctc_sizes("ctc_loss_backward", inputs, attrs)
    grad_loss = inputs[4]
    if tuple(grad_loss.dim) != loss_dims(attrs.reduction, batch):
        fail("ctc_loss_backward", f"grad_loss {grad_loss.name!r} must be {list(loss_dims(attrs.reduction, batch))} "
                                  f"(reduction {attrs.reduction!r}), got {list(grad_loss.dim)}")
    if not grad_loss.data_type.is_floating:
        fail("ctc_loss_backward", f"grad_loss {grad_loss.name!r} must be floating, got {grad_loss.data_type.name}")
    log_alpha = inputs[5] if len(inputs) > 5 else None
    if log_alpha is not None and (tuple(log_alpha.dim) != alpha_dims(inputs, steps, batch)
                                  or log_alpha.data_type != dtypes.float32):
        fail("ctc_loss_backward", f"log_alpha {log_alpha.name!r} must be float32 "
                                  f"{list(alpha_dims(inputs, steps, batch))} (ctc_loss's second output), got "
                                  f"{log_alpha.data_type.name} {list(log_alpha.dim)}")
    return [OutputSpec(tuple(inputs[0].dim), layout_source=0)]


# --- the float64 reference ------------------------------------------------------------------------
def label_sequences(op: str, targets: torch.Tensor, input_lengths, target_lengths, steps: int,
                    classes: int) -> list:
    """[(input_length, labels)] per batch entry from host values; ValidationError where a length
    is out of range or a label is not a class."""
    inputs = [int(v) for v in input_lengths.reshape(-1).tolist()]
    lengths = [int(v) for v in target_lengths.reshape(-1).tolist()]
    width = targets.shape[1] if targets.dim() == 2 else targets.shape[0]
    sequences, start = [], 0
    for entry, (frames, length) in enumerate(zip(inputs, lengths)):
        if not 0 <= frames <= steps:
            fail(op, f"input_lengths[{entry}] = {frames} is outside [0, T={steps}]")
        if length < 0 or (targets.dim() == 2 and length > width):
            fail(op, f"target_lengths[{entry}] = {length} is outside [0, S={width}]")
        if targets.dim() == 2:
            labels = targets[entry, :length]
        else:
            if start + length > width:
                fail(op, f"target_lengths sum past the {width} concatenated targets at entry {entry}")
            labels, start = targets[start:start + length], start + length
        labels = [int(v) for v in labels.tolist()]
        if any(not 0 <= label < classes for label in labels):
            fail(op, f"targets of entry {entry} hold a label outside [0, C={classes}): {labels}")
        sequences.append((frames, labels))
    return sequences


def extended(labels: list, blank: int) -> list:
    """The target with a blank before, between and after its labels."""
    states = [blank]
    for label in labels:
        states += [label, blank]
    return states


def _logsumexp(*terms: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(terms))) elementwise: -inf where every term is, NaN where any is."""
    stacked = torch.stack(terms)
    top = stacked.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return top + torch.log(torch.exp(stacked - top).sum(dim=0))


def _shifted(row: torch.Tensor, by: int, allowed: torch.Tensor) -> torch.Tensor:
    """row moved `by` states along (positive: from lower states), -inf where not allowed."""
    moved, count = torch.full_like(row, -math.inf), row.numel()
    if 0 < by < count:
        moved[by:] = row[:-by]
    elif 0 < -by < count:
        moved[:by] = row[-by:]
    return torch.where(allowed, moved, torch.full_like(row, -math.inf))


def alignment(log_probs: torch.Tensor, frames: int, labels: list, blank: int):
    """(log_alpha [frames, L], log_beta [frames, L], nll) of one batch entry (log_probs [T, C])."""
    states = torch.tensor(extended(labels, blank), dtype=torch.long)
    count = states.numel()
    position = torch.arange(count)
    skip = torch.zeros(count, dtype=torch.bool)  # alpha may come from s - 2: two different labels
    skip[2:] = (position[2:] % 2 == 1) & (states[2:] != states[:-2])
    skip_down = torch.zeros(count, dtype=torch.bool)  # beta may come from s + 2
    skip_down[:-2] = skip[2:]
    emit = log_probs[:frames, states]
    alpha = torch.full((frames, count), -math.inf, dtype=log_probs.dtype)
    beta = torch.full((frames, count), -math.inf, dtype=log_probs.dtype)
    if frames == 0:
        return alpha, beta, (0.0 if not labels else math.inf)
    alpha[0] = torch.where(position < 2, emit[0], torch.full_like(emit[0], -math.inf))
    for t in range(1, frames):
        prev = alpha[t - 1]
        alpha[t] = emit[t] + _logsumexp(prev, _shifted(prev, 1, position >= 1), _shifted(prev, 2, skip))
    last = frames - 1
    beta[last] = torch.where(position >= count - 2, emit[last], torch.full_like(emit[last], -math.inf))
    for t in range(last - 1, -1, -1):
        nxt = beta[t + 1]
        beta[t] = emit[t] + _logsumexp(nxt, _shifted(nxt, -1, position < count - 1), _shifted(nxt, -2, skip_down))
    ends = alpha[last, -2:] if count > 1 else alpha[last, -1:]
    nll = -float(_logsumexp(*ends.unbind(0)))
    return alpha, beta, nll


def _per_entry(values, attrs: CtcLossAttrs, op: str):
    log_probs, targets, input_lengths, target_lengths = values[:4]
    steps, batch, classes = log_probs.shape
    sequences = label_sequences(op, targets, input_lengths, target_lengths, steps, classes)
    return [(entry, frames, labels, alignment(log_probs[:, entry], frames, labels, attrs.blank))
            for entry, (frames, labels) in enumerate(sequences)]


def _reduced(losses: torch.Tensor, lengths, attrs: CtcLossAttrs) -> torch.Tensor:
    if attrs.zero_infinity:
        losses = torch.where(losses == math.inf, torch.zeros_like(losses), losses)
    if attrs.reduction == "none":
        return losses
    if attrs.reduction == "sum":
        return losses.sum().reshape(1)
    return (losses / lengths.to(losses.dtype).clamp(min=1)).mean().reshape(1)


def reference(values, attrs: CtcLossAttrs):
    log_probs, targets = values[:2]
    steps, batch = log_probs.shape[:2]
    entries = _per_entry(values, attrs, "ctc_loss")
    losses = torch.tensor([nll for *_, (_, _, nll) in entries], dtype=log_probs.dtype)
    log_alpha = torch.full((batch, steps, 2 * targets.shape[-1] + 1), -math.inf, dtype=log_probs.dtype)
    for entry, frames, labels, (alpha, _, _) in entries:
        log_alpha[entry, :frames, :alpha.shape[1]] = alpha
    return [_reduced(losses, values[3].reshape(-1).cpu(), attrs).to(log_probs.device), log_alpha.to(log_probs.device)]


def loss_scales(grad_loss: torch.Tensor, lengths: torch.Tensor, attrs: CtcLossAttrs, batch: int) -> torch.Tensor:
    """g_n: the gradient of the reduced loss with respect to each entry's loss."""
    grad = grad_loss.reshape(-1)
    if attrs.reduction == "none":
        return grad
    if attrs.reduction == "sum":
        return grad.expand(batch)
    return grad.expand(batch) / lengths.to(grad.dtype).clamp(min=1) / batch


def absent_term(nll: float) -> float:
    """What a class no state carries adds to its occupancy in torch's formula: 0 for a finite
    loss, NaN for an infinite (or NaN) one, so such a loss's frames are NaN in every class."""
    return math.exp(-math.inf + nll) if not math.isnan(nll) else math.nan


def reference_backward(values, attrs: CtcLossAttrs):
    log_probs, grad_loss = values[0], values[4]
    steps, batch, classes = log_probs.shape
    scales = loss_scales(grad_loss.cpu(), values[3].reshape(-1).cpu(), attrs, batch)
    grad = torch.zeros(log_probs.shape, dtype=log_probs.dtype)
    lp = log_probs.cpu()
    for entry, frames, labels, (alpha, beta, nll) in _per_entry(values, attrs, "ctc_loss_backward"):
        if frames == 0 or (attrs.zero_infinity and nll == math.inf):
            continue
        states = torch.tensor(extended(labels, attrs.blank), dtype=torch.long)
        emit = lp[:frames, entry][:, states]
        per_state = torch.exp(alpha + beta + nll - emit)  # [frames, L]: occupancy / p of its class
        occupancy = torch.zeros(frames, classes, dtype=lp.dtype).index_add_(1, states, per_state)
        # torch's sum starts every class at exp(-inf + nll - lp): 0, but NaN for an infinite loss
        occupancy = occupancy + absent_term(nll)
        grad[:frames, entry] = (torch.exp(lp[:frames, entry]) - occupancy) * scales[entry]
    return [grad.to(log_probs.device)]


# The loss reads every class of every frame along the alignments: no prologue, and its [N] (or
# [1]) result has nothing to fuse into.
register(OpDef("ctc_loss", "ctc", "anchor", CtcLossAttrs,
               ("log_probs", "targets", "input_lengths", "target_lengths"), ("loss", "log_alpha"), infer, reference,
               fusion=AnchorRule((), None)))
register(OpDef("ctc_loss_backward", "ctc", "anchor", CtcLossAttrs,
               ("log_probs", "targets", "input_lengths", "target_lengths", "grad_loss", "log_alpha"),
               ("grad_log_probs",), infer_backward, reference_backward, optional=("log_alpha",),
               fusion=AnchorRule((), None)))


@backward_rule("ctc_loss")
def _ctc_backward(d, node, grads):
    """d log_probs from the loss's gradient; targets and lengths take none."""
    log_probs = node.inputs[0]
    if grads[0] is None or not d.needs(log_probs):
        return [None, None, None, None]
    # the forward's log_alpha saves the gradient kernel one of its two passes over the frames;
    # concatenated targets would make it [N, T, 2 * (all labels) + 1]: recomputed there instead
    padded = len(node.inputs[1].dim) == 2
    operands = [d.value(t) for t in node.inputs] + [grads[0], d.value(node.outputs[1]) if padded else None]
    return [d.graph._add_op("ctc_loss_backward", operands, node.attrs)[0], None, None, None]
