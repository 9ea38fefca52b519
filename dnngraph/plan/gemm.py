"""What every GEMM-shaped group's builder shares (matmul, convolution): the group's prologue
leaves and chains, and the launches of one config (main, split-K combine, row-exit fold).

A family's build object supplies `spec(config, suffix, **extra)` (its loaders and operands),
`problem` (batch, m, n), `group`, `exit_operands` and `device`; `build_gemm` schedules (or
autotunes) it and returns the launches.
"""
from __future__ import annotations

from ..codegen.cache import load_kernel
from ..codegen.gemm import ExitPlan, render
from ..heuristics.autotune import TuningRecord
from ..heuristics.matmul import SPLIT_COMBINE_BLOCK, MatmulConfig
from .launch import KernelLaunch, sample_tensors, scratch, time_candidate, tuning_device

EXIT_FOLD_WARPS = 4
COMBINE_WARPS = 4


def leaves(tensor, members) -> list:
    """Group inputs a prologue chain ending in `tensor` reads (the tensor itself if no chain)."""
    if tensor.producer is None or tensor.producer not in members:
        return [tensor]
    found = []
    for source in tensor.producer.input_tensors():
        found += [t for t in leaves(source, members) if all(t is not f for f in found)]
    return found


def unique(tensors) -> list:
    """`tensors` without repeats, in order."""
    seen, result = set(), []
    for t in tensors:
        if t.uid not in seen:
            seen.add(t.uid)
            result.append(t)
    return result


def chain(tensor, prologue) -> set:
    """The prologue nodes the value `tensor` depends on."""
    found, stack = set(), [tensor]
    while stack:
        t = stack.pop()
        if t.producer in prologue and t.producer not in found:
            found.add(t.producer)
            stack += t.producer.input_tensors()
    return found


def epilogue_inputs(group) -> list:
    """Tensors from outside the group that its epilogue reads."""
    members = set(group.nodes)
    found = []
    for node in group.epilogue:
        found += [t for t in node.input_tensors() if t.producer not in members]
    return unique(found)


class GemmLaunches:
    """The launches of one config of a GEMM-shaped group (mixed into each family's build)."""

    def _launch(self, spec, body, grid, warps, stages, config_text, reason, scratch_buffers=()):
        source, arguments = render(spec, body)
        kernel, path = load_kernel(source, spec.name)
        return KernelLaunch(self.group, kernel, path, arguments, grid, warps, config_text, reason,
                            scratch_buffers, num_stages=stages)

    def launches(self, config: MatmulConfig, reason: str) -> list[KernelLaunch]:
        """The kernels of this group under `config`: main (+ combine) (+ exit fold)."""
        p = self.problem
        tiles = -(-p.m // config.block_m) * -(-p.n // config.block_n)
        epilogue_block = (config.block_m, config.block_n)
        split = config.split_k > 1
        if split:
            epilogue_block = SPLIT_COMBINE_BLOCK
        exit_scratch = [scratch((p.batch, -(-p.n // epilogue_block[1]), p.m)) for _ in self.group.exits]
        exits = [ExitPlan(x, x.inputs[0].uid, s.uid, op)
                 for x, op, s in zip(self.group.exits, self.exit_operands, exit_scratch)]
        common = dict(exits=tuple(exits), epilogue_block=epilogue_block)
        text = config.text
        launches = []
        if config.variant == "persistent":
            programs = min(tiles * p.batch, self.device.sms)  # one program per SM
            spec = self.spec(config, persistent_programs=programs, **common)
            launches.append(self._launch(spec, "persistent", (programs,), config.num_warps, config.num_stages,
                                         text + f" grid={programs}", reason, exit_scratch))
            # pointers below 16-byte alignment cannot feed a descriptor: the tiled kernel runs then
            fallback = MatmulConfig("tiled", config.block_m, config.block_n, config.block_k, config.num_warps,
                                    config.num_stages)
            launches[0].alternative = self._launch(self.spec(fallback, "_unaligned", **common), "tiled",
                                                   (tiles, p.batch), config.num_warps, config.num_stages,
                                                   fallback.text, reason)
        elif split:
            partial = scratch((config.split_k, p.batch, p.m, p.n))
            spec = self.spec(config, partial_uid=partial.uid, **common)
            launches.append(self._launch(spec, config.variant, (tiles, p.batch, config.split_k), config.num_warps,
                                         config.num_stages, text, reason, [partial]))
            combine_tiles = -(-p.m // epilogue_block[0]) * -(-p.n // epilogue_block[1])
            launches.append(self._launch(self.spec(config, "_combine", partial_uid=partial.uid, **common),
                                         "combine", (combine_tiles, p.batch), COMBINE_WARPS, None,
                                         f"split-K combine {epilogue_block[0]}x{epilogue_block[1]}",
                                         "adds the SPLIT_K partials in order (deterministic)", exit_scratch))
        else:
            spec = self.spec(config, **common)
            launches.append(self._launch(spec, config.variant, (tiles, p.batch), config.num_warps,
                                         config.num_stages, text + f" grid={tiles}x{p.batch}", reason,
                                         exit_scratch))
        if exits:
            rows = -(-(p.batch * p.m) // 128)
            launches.append(self._launch(self.spec(config, "_exits", **common), "exit_fold", (rows,),
                                         EXIT_FOLD_WARPS, None, "row-exit fold",
                                         "folds per-tile row partials in tile order (deterministic)"))
        return launches


def build_gemm(build, family: str, schedule, tuner=None, device=None) -> list[KernelLaunch]:
    """The launches of a GEMM-shaped group: the model's choice (`schedule(problem, device)`),
    or the autotuned one with `tuner`, recorded under `family` in the tuning cache."""
    sched = schedule(build.problem, build.device)
    config, record = sched.config, TuningRecord("model", sched.config.text)
    if tuner is not None:
        device = tuning_device(device)
        tensors = sample_tensors(build.group, device)
        config, record = tuner.choose(
            family, build.problem.signature(), list(sched.ranked), MatmulConfig.to_record,
            MatmulConfig.from_record, lambda c: c.text,
            lambda c: time_candidate(build.launches(c, "autotune candidate"), tensors, device))
    reason = record.describe() or sched.reason
    launches = build.launches(config, reason)
    for launch in launches:
        launch.tuning = record
    return launches
