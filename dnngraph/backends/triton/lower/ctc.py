"""Build the launches of a CTC group: the loss (and its reduction) or the gradient."""
from __future__ import annotations

from ....errors import ExecutionError, ValidationError
from ....ops.ctc import label_sequences
from ....problems.ctc import ctc_problem
from ....runtime.launch import kernel_name, launch_of, scratch
from ..codegen.ctc import render_gradient, render_loss, render_occupancy, render_reduce
from ..heuristics.ctc import schedule


def build_ctc(graph, group, context):
    """The loss kernel (and the reduction of a "sum" or "mean" loss), or the gradient kernel."""
    anchor = group.anchor
    geometry = ctc_problem(graph, group).geometry
    where = f"node {anchor.name!r} ({anchor.op})"
    config = schedule(geometry, where, context.device.type == "cpu")
    name, summary = kernel_name(group), group.summary()
    checks = _host_checks(anchor, geometry)
    programs = geometry.batch
    reason = (f"one program per batch entry ({programs}), its {2 * geometry.label_width + 1} extended states in "
              f"registers (BLOCK_L={config.block_l}), the recursion over T={geometry.steps} frames in log space")
    if anchor.op == "ctc_loss_backward":
        return _gradient_launches(group, geometry, config, name, summary, reason, checks, context.budget)
    loss = anchor.outputs[0]
    # log_alpha is stored only where something reads it (the gradient of a training step)
    log_alpha = next((t for t in group.outputs if t is anchor.outputs[1]), None)
    if log_alpha is not None:
        reason += "; log_alpha stored for the gradient"
    if geometry.reduction == "none":
        source = render_loss(name, group, geometry, config, loss.uid, int(loss.stride[0]), log_alpha, summary)
        return launch_of(group, source, programs, config.recursion_warps, config.text(), reason, host_checks=checks)
    losses = scratch((geometry.batch,))
    source = render_loss(name, group, geometry, config, losses.uid, 1, log_alpha, summary)
    entries = launch_of(group, source, programs, config.recursion_warps, config.text(),
                        reason + f"; entry losses in scratch, then one program takes their {geometry.reduction}",
                        scratch=(losses,), host_checks=checks)
    source = render_reduce(name + "_reduce", geometry, config, losses.uid, loss, f"{geometry.reduction} of {summary}")
    fold = launch_of(group, source, 1, 1, f"BLOCK_N={config.block_n} num_warps=1",
                     f"the {geometry.reduction} of {geometry.batch} entry losses in one program, in order "
                     f"(deterministic, no atomics)")
    return [entries, fold]


def _gradient_launches(group, geometry, config, name, summary, reason, checks, budget) -> list:
    """The recursions (one program per entry: the sequential part), then d log_probs of every
    (frame, entry) in parallel from their per-state rows."""
    rows, nll = scratch((geometry.batch, geometry.steps, config.block_l)), scratch((geometry.batch,))
    nbytes = rows.nbytes + nll.nbytes
    spent = "" if budget is None else "; " + budget.describe(nbytes)  # needed: there is no variant without
    if budget is not None:
        budget.spend(nbytes)
    log_alpha = group.anchor.inputs[5]
    source = render_occupancy(name + "_recursions", group, geometry, config, rows.uid, nll.uid, log_alpha, summary)
    alpha = "the forward's log_alpha read" if log_alpha is not None else "log_alpha rows in scratch"
    recursions = launch_of(group, source, geometry.batch, config.recursion_warps, config.text(),
                           reason + f"; {alpha}, then log_beta from the last frame back, each scratch row "
                           f"({rows.nbytes} bytes) becoming its states' occupancy{spent}", scratch=(rows, nll),
                           host_checks=checks)
    source = render_gradient(name, group, geometry, config, rows.uid, nll.uid, summary)
    frame_blocks = -(-geometry.steps // config.block_t)
    frames = launch_of(group, source, (frame_blocks, geometry.batch), config.num_warps, config.text(),
                       f"one program per ({config.block_t} frames, entry) = {frame_blocks} x {geometry.batch}, each "
                       f"summing its states' occupancy per class, {config.block_c} classes at a time")
    return [recursions, frames]


def _host_checks(anchor, geometry) -> tuple:
    """The check of bound lengths and labels on the host (graph inputs' values; an intermediate
    is not written when the checks run): ExecutionError naming the node where a length is out of
    range or a label is not a class, before any kernel writes."""
    targets, input_lengths, target_lengths = anchor.inputs[1:4]
    if any(t.producer is not None for t in (targets, input_lengths, target_lengths)):
        return ()

    def check(tensors):
        try:
            label_sequences(anchor.op, tensors[targets.uid], tensors[input_lengths.uid], tensors[target_lengths.uid],
                            geometry.steps, geometry.classes)
        except ValidationError as error:
            raise ExecutionError(f"node {anchor.name!r} ({anchor.op}): {error}") from None
    return (check,)
