"""Build the launch of a recurrence group: schedule, render, launch (one launch per layer and
direction, every time step inside the kernel)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ....errors import ExecutionError, UnsupportedError, ValidationError
from ....ops.rnn import sequence_lengths
from ....problems.rnn import rnn_problem
from ..codegen.rnn import render as render_rnn
from ..heuristics.matmul import choose_dot
from ..heuristics.mma import fitting_warps
from ....runtime.launch import kernel_name, launch_of

MIN_DOT = 16  # tl.dot's smallest extent on every axis
MAX_BLOCK_B = 64
# the widest hidden / state tile one program holds; the recurrent weights of every gate stay in
# registers for the whole sequence when both fit one tile and all gates' tiles take at most
# RESIDENT_BYTES (128 bytes a thread at 8 warps: more spills, measured with ptxas for sm_90)
GPU_BLOCK = 64
RESIDENT_BYTES = 32 * 1024
NUM_WARPS = 8
CPU_BLOCK = 128  # the interpreter runs a tile op at numpy speed: fewer, larger tiles


@dataclass(frozen=True)
class RnnSchedule:
    block_b: int
    block_h: int
    block_k: int
    resident: bool  # the recurrent weights are loaded once, before the time loop
    num_warps: int
    # one launch per step (two backward: the gate gradients, then dh) over (batch block, hidden
    # block) programs, after one that writes the initial state: a layer too wide for one
    # program's tile on the GPU, without projection
    step_launches: bool = False


def _tile(extent: int, cap: int) -> int:
    return min(cap, max(MIN_DOT, 1 << (max(1, extent) - 1).bit_length()))


def schedule_rnn(geometry, interpreted: bool, weight_bytes: int = 2, fma_dots: bool = False) -> RnnSchedule:
    """Tiles of one recurrence; `weight_bytes` the recurrent weight's element size, `fma_dots`
    whether its dots are IEEE fp32 (the FMA units, no tensor cores)."""
    cap = CPU_BLOCK if interpreted else GPU_BLOCK
    block_b = _tile(geometry.batch, MAX_BLOCK_B if interpreted else 16)
    block_h = _tile(max(geometry.hidden, geometry.state), cap)
    block_k = _tile(max(geometry.state, geometry.hidden) if geometry.op != "rnn_recurrence" else geometry.state, cap)
    fits = geometry.gates * block_h * block_k * weight_bytes <= RESIDENT_BYTES or interpreted
    forward = geometry.op == "rnn_recurrence"
    resident = forward and geometry.hidden <= block_h and geometry.state <= block_k and fits
    steps = not interpreted and geometry.hidden > block_h and geometry.state == geometry.hidden
    # every dot of a step has the batch tile's rows; the gates' dots stand alone, the
    # projection's may chain to them through registers: no more warps than either layout of
    # those rows fills (heuristics/mma.py)
    warps = NUM_WARPS
    if not fma_dots:
        warps = min(fitting_warps(block_b, (block_h, block_k), warps, chained=chained) for chained in (False, True))
    return RnnSchedule(block_b, block_h, block_k, resident, warps, steps)


def build_rnn(graph, group, context):
    """The recurrence kernel of one rnn_recurrence(_backward) node."""
    geometry = rnn_problem(graph, group).geometry
    node = group.anchor
    if len(group.nodes) != 1:
        raise UnsupportedError(f"node {node.name!r} ({node.op}): the recurrence fuses nothing")
    w_hh = node.inputs[3 if node.op == "rnn_recurrence" else 1]
    floating = [t for t in node.input_tensors() if t.data_type.is_floating]
    dot = choose_dot(floating[0].data_type.name, w_hh.data_type.name, floating[0].data_type.triton_type,
                     w_hh.data_type.triton_type, geometry.allow_tf32)
    # the build's target picks the tiles (an H200's for CPU tensors too, run interpreted)
    schedule = schedule_rnn(geometry, context.target.interpreted, w_hh.data_type.itemsize, dot.precision == "ieee")
    name = kernel_name(group)
    source = render_rnn(name, schedule, node, geometry, dot, group.summary())
    programs = -(-geometry.batch // schedule.block_b)
    checks = _length_checks(node, geometry.steps, geometry.batch)
    if schedule.step_launches:
        return _step_launches(group, source, schedule, geometry, dot, programs, checks)
    config_text = (f"BLOCK_B={schedule.block_b} BLOCK_H={schedule.block_h} BLOCK_K={schedule.block_k} "
                   f"{'resident' if schedule.resident else 'streamed'} num_warps={schedule.num_warps} grid={programs}")
    where = "forward" if node.op == "rnn_recurrence" else "backward through time"
    weights = ("recurrent weights loaded once and kept in registers for every step" if schedule.resident else
               f"recurrent weights read per step in [{schedule.block_k}, {schedule.block_h}] tiles (too wide to "
               "keep on chip)")
    reason = (f"persistent {geometry.mode} {where}: one launch, one program per {schedule.block_b} batch rows owning "
              f"the whole hidden size ({geometry.hidden}) and looping over all {geometry.steps} steps; {weights}; "
              f"gates fused into the step; {dot.dot} dot")
    return launch_of(group, source, programs, schedule.num_warps, config_text, reason, host_checks=checks)


def _step_launches(group, source, schedule, geometry, dot, programs, checks) -> list:
    """The initial-state launch, then per step one launch (forward) or two (backward: the gate
    gradients, then dh = dgates @ w_hh) over (batch block, hidden block) programs: a step reads
    the whole previous state (or every gate gradient), which only a kernel boundary orders across
    programs."""
    blocks = -(-geometry.hidden // schedule.block_h)
    forward = geometry.op == "rnn_recurrence"
    per_step = [(k, 1, None) for k in range(geometry.steps)] if forward else \
        [(k, 1, phase) for k in range(geometry.steps) for phase in (1, 2)]
    launches = []
    for first, count, phase in [(0, 0, 0 if not forward else None)] + per_step:
        values = {"k_first": first, "k_count": count, "phases": phase}
        arguments = tuple(replace(a, value=values[a.name]) if a.name in values else a for a in source.arguments)
        what = "initial" if not count else f"{first}" + ("" if forward else f" phase {phase}")
        config_text = (f"BLOCK_B={schedule.block_b} BLOCK_H={schedule.block_h} BLOCK_K={schedule.block_k} step "
                       f"{what} num_warps={schedule.num_warps} grid={programs}x{blocks}")
        work = ("each compute one hidden block of every gate" if forward else
                "each compute the gate gradients of one hidden block, then (a second launch) one block of dh")
        reason = (f"{geometry.mode} {'forward' if forward else 'backward through time'}, launches per step "
                  f"({len(per_step)} + 1 for the initial state): hidden {geometry.hidden} is wider than one "
                  f"program's tile ({schedule.block_h}), so {blocks} programs per batch block {work}, the weights "
                  f"read per step in [{schedule.block_k}, {schedule.block_h}] tiles; gates fused; {dot.dot} dot")
        launches.append(launch_of(group, replace(source, arguments=arguments), (programs, blocks), schedule.num_warps,
                                  config_text, reason, host_checks=checks if not launches else ()))
    return launches


def _length_checks(node, steps: int, batch: int) -> tuple:
    """Bound lengths outside [0, T] are refused on the host before any launch (the kernel clamps
    them where it cannot check: on the GPU, with no sync)."""
    lengths = node.inputs[6 if node.op == "rnn_recurrence" else 4]
    if lengths is None or lengths.producer is not None:
        return ()

    def check(tensors):
        try:
            sequence_lengths(tensors[lengths.uid], steps, batch)
        except ValidationError as error:
            raise ExecutionError(f"node {node.name!r} ({node.op}): {error}") from None
    return (check,)
