"""What every GEMM-shaped group's builder shares (matmul, convolution): the group's prologue
leaves and chains, and the launches of one config (main, split-K combine, row-exit fold).

A family's build object supplies `spec(config, suffix, **extra)` (its loaders and operands),
`problem` (batch, m, n), `group`, `exit_operands` and `target`; `build_gemm` schedules (or
autotunes) it and returns the launches.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..codegen.emitter import blends_of
from ..codegen.gemm import EXIT_FOLD_BLOCK, ExitPlan, render
from ....runtime.autotune import TuningRecord
from ..heuristics.matmul import COLUMN_FOLD_BLOCK, SPLIT_COMBINE_BLOCK, MatmulConfig, shared_bytes
from ....problems.base import fast_math_outputs
from ....target import laid_out
from ....runtime.launch import KernelLaunch, launch_of, sample_tensors, scratch, time_candidate

EXIT_FOLD_WARPS = 4
COMBINE_WARPS = 4
TMA_ALIGNMENT = 16  # bytes: descriptor base addresses and row pitches
TMA_BOX_LIMIT = 256  # elements per block axis a TMA copy moves
# outputs a descriptor may store (TMA handles any 1-8 byte type; the floating ones are the
# outputs GEMM epilogues write in practice and the ones tested)
TMA_STORE_TYPES = frozenset({"float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2"})


def tma_store_ok(op, config: MatmulConfig) -> bool:
    """Whether output `op` can be stored through a descriptor under `config`: one row axis with a
    16-byte pitch, unit column stride, 16-byte batch strides, no start offset, a TMA type, and
    column subtiles of at least 16 bytes (the base address is checked at run time: an unaligned
    one runs the tiled alternative)."""
    if op.data_type.name not in TMA_STORE_TYPES or op.offset or len(op.row_strides) != 1:
        return False
    if op.col_strides != (1,) or op.row_stride <= 0:
        return False
    itemsize = op.data_type.itemsize
    sub_n = config.block_n // config.epilogue_subtile
    if sub_n * itemsize < TMA_ALIGNMENT or max(sub_n, config.block_m) > TMA_BOX_LIMIT:
        return False
    return all(s * itemsize % TMA_ALIGNMENT == 0 for s in (op.row_stride,) + tuple(op.batch_strides))


# shared memory the compiler adds beyond the staging buffers (mbarriers); measured 24-32 bytes
# on sm_90 builds of the persistent kernel
BARRIER_BYTES = 64


def tma_stores_that_fit(stored, config: MatmulConfig, problem, shared_memory: int) -> tuple:
    """The outputs stored through descriptors (none under flatten): those that qualify (tma_store_ok), in order, while
    their staging buffers (one column subtile each) fit in the `shared_memory` bytes of a block
    beside the operand stages; the others keep pointer stores. An fp32 side output beside a bf16
    one at 128x256 needed 245784 bytes, over the 232448 an H100 block has."""
    if not config.tma_store or config.flatten:
        # flatten pipelines the next tile's loads across this tile's stores: its build needed
        # 278552 bytes where the stages and one bf16 staging buffer count 180224 (not modelled)
        return ()
    room = shared_memory - BARRIER_BYTES - shared_bytes(replace(config, tma_store=False), problem)
    chosen = []
    for op in stored:
        staging = config.block_m * (config.block_n // config.epilogue_subtile) * op.data_type.itemsize
        if tma_store_ok(op, config) and staging <= room:
            chosen.append(op.uid)
            room -= staging
    return tuple(chosen)


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

    # the problem at the top of the bucket a dynamic graph was specialised at, where configs are
    # chosen (a family's build sets it; None: self.problem, a static graph's)
    top_problem = None
    # workspace buffers an earlier launch of the group fills and these kernels read (a staged
    # filter): autotuning allocates them, as timing does not depend on their values
    read_scratch = ()

    @property
    def choosing_problem(self):
        """The problem configs are chosen for: the bucket's top, else self.problem."""
        return self.top_problem if self.top_problem is not None else self.problem

    def exit_plans(self, epilogue_block) -> list:
        """(ExitPlan, its partials' scratch) of the row exits (reductions over each output row):
        one partial per column tile of `epilogue_block`, folded in tile order. A family with
        other exits overrides this."""
        p = self.problem
        pairs = []
        for node, operand in zip(self.group.exits, self.exit_operands):
            partial = scratch((p.batch, -(-p.n // epilogue_block[1]), p.m))
            pairs.append((ExitPlan(node, partial.uid, operand), partial))
        return pairs

    def _launch(self, spec, body, grid, warps, stages, config_text, reason, scratch_buffers=()):
        # every kernel; its stores say which blend, its epilogue which outputs take 16-bit math
        spec = replace(spec, blends=blends_of(self.group.outputs), fast_math=fast_math_outputs(self.group))
        return launch_of(self.group, render(spec, body), grid, warps, config_text, reason,
                         scratch=scratch_buffers, num_stages=stages)

    def launches(self, config: MatmulConfig, reason: str) -> list[KernelLaunch]:
        """The kernels of this group under `config`: main (+ combine) (+ exit fold)."""
        p = self.problem
        tiles = -(-p.m // config.block_m) * -(-p.n // config.block_n)
        epilogue_block = (config.block_m, config.block_n)
        split = config.split_k > 1
        if split:
            epilogue_block = SPLIT_COMBINE_BLOCK
        pairs = self.exit_plans(epilogue_block)
        exits, exit_scratch = [plan for plan, _ in pairs], [partial for _, partial in pairs]
        common = dict(exits=tuple(exits), epilogue_block=epilogue_block, column_fold=COLUMN_FOLD_BLOCK)
        # more batch entries (or splits) than grid axis y (z) takes: (tile, batch[, split]) on axis
        # x; decided at the bucket's top, as it changes the source
        fold = not self.target.grid_fits((1, self.choosing_problem.batch, config.split_k))
        if fold:
            common["fold_batch"] = True
        grid = lambda *counts: laid_out(counts, fold)
        text = config.text
        launches = []
        if config.variant == "persistent":
            # one program per SM (a constexpr: counted at the bucket's top; a program past the
            # tiles of a smaller size finds none)
            top = self.choosing_problem
            programs = min(-(-top.m // config.block_m) * -(-top.n // config.block_n) * top.batch, self.target.sms)
            # a blended output reads its prior in the store: a plain tl.store, not a descriptor's
            blended = {uid for uid, _ in blends_of(self.group.outputs)}
            stored = [op for op in self.operands if op.side == "c" and op.is_output and op.uid not in blended]
            tma_stores = tma_stores_that_fit(stored, config, p, self.target.shared_memory)
            spec = self.spec(config, persistent_programs=programs, tma_store_uids=tma_stores, **common)
            stores = f" tma-stores={len(tma_stores)}" if config.tma_store else ""  # those that qualified and fit
            launches.append(self._launch(spec, "persistent", (programs,), config.num_warps, config.num_stages,
                                         text + stores + f" grid={programs}", reason, exit_scratch))
            # pointers below 16-byte alignment cannot feed a descriptor: the tiled kernel runs then
            fallback = MatmulConfig("tiled", config.block_m, config.block_n, config.block_k, config.num_warps,
                                    config.num_stages)
            launches[0].alternative = self._launch(self.spec(fallback, "_unaligned", **common), "tiled",
                                                   grid(tiles, p.batch), config.num_warps, config.num_stages,
                                                   fallback.text, reason)
        elif split:
            # int32 partials of an int8 dot: the sum stays exact through the combine
            partial = scratch((config.split_k, p.batch, p.m, p.n), torch.int32 if p.dot == "int8" else torch.float32)
            spec = self.spec(config, partial_uid=partial.uid, **common)
            launches.append(self._launch(spec, config.variant, grid(tiles, p.batch, config.split_k), config.num_warps,
                                         config.num_stages, text, reason, [partial]))
            combine_tiles = -(-p.m // epilogue_block[0]) * -(-p.n // epilogue_block[1])
            launches.append(self._launch(self.spec(config, "_combine", partial_uid=partial.uid, **common),
                                         "combine", grid(combine_tiles, p.batch), COMBINE_WARPS, None,
                                         f"split-K combine {epilogue_block[0]}x{epilogue_block[1]}",
                                         "adds the SPLIT_K partials in order (deterministic)", exit_scratch))
        else:
            spec = self.spec(config, **common)
            launches.append(self._launch(spec, config.variant, grid(tiles, p.batch), config.num_warps,
                                         config.num_stages, text + f" grid={tiles}x{p.batch}" + " folded" * fold, reason,
                                         exit_scratch))
        if exits:
            column = exits[0].axis == "column"
            rows = -(-(p.batch * (p.n if column else p.m)) // (COLUMN_FOLD_BLOCK[1] if column else EXIT_FOLD_BLOCK))
            launches.append(self._launch(self.spec(config, "_exits", **common), "exit_fold", (rows,),
                                         EXIT_FOLD_WARPS, None, f"{exits[0].axis}-exit fold",
                                         "folds per-tile partials in tile order (deterministic)"))
        return launches


def split_partial_bytes(config: MatmulConfig, problem) -> int:
    """Workspace of a config's split-K partials (fp32, or int32 for an int8 dot: [SPLIT_K, batch, M, N])."""
    return config.split_k * problem.batch * problem.m * problem.n * 4 if config.split_k > 1 else 0


def build_gemm(build, family: str, schedule, context) -> list[KernelLaunch]:
    """The launches of a GEMM-shaped group: the model's choice (`schedule(problem, target)`),
    or the autotuned one with the context's tuner, recorded under `family` in the tuning cache;
    configs whose split-K partials do not fit the context's budget are left out."""
    tuner, budget = context.tuner, context.budget
    # chosen at the bucket's top (the same config for every size of it), within the budget there
    sched = schedule(build.choosing_problem, build.target)
    fits = lambda c: budget is None or budget.allows(split_partial_bytes(c, build.choosing_problem))
    ranked = [c for c in sched.ranked if fits(c)]
    skipped = sched.ranked.index(ranked[0])
    config, record = ranked[0], TuningRecord("model", ranked[0].text)
    if tuner is not None:
        device = context.device
        tensors = sample_tensors(build.group, device)
        tensors.update({b.uid: torch.empty(b.dim, dtype=b.torch_dtype, device=device) for b in build.read_scratch})
        limit = "" if budget is None or budget.limit is None else f" ws{budget.limit}"
        config, record = tuner.choose(
            family, build.choosing_problem.signature() + limit, ranked, MatmulConfig.to_record,
            MatmulConfig.from_record, lambda c: c.text,
            lambda c: time_candidate(build.launches(c, "autotune candidate"), tensors, device))
    nbytes = split_partial_bytes(config, build.problem)
    reason = record.describe() or (sched.reason if not skipped else
                                   f"model rank {skipped + 1} of {len(sched.ranked)}: the {skipped} ranked "
                                   f"above need more workspace than the limit")
    if budget is not None:
        budget.spend(nbytes)
        reason += "; " + budget.describe(nbytes)
    launches = build.launches(config, reason)
    for launch in launches:
        launch.tuning = record
    return launches
