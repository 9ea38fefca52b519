"""Build the launches of a row group (reductions, softmax, norms): one kernel, or partial,
combine and apply kernels in split mode; norm backward adds a dscale/dbias kernel where those
are not per-row sums of the dx kernel, or (layernorm, rmsnorm where the column sums of a row fit
a program's registers: every width up to 16384 at two sums) takes them as column sums in the dx
kernel and adds only a combine of their partials."""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from ..codegen.recipes import RECIPES, norm_parameter_grads
from ..codegen.rows import RowKernelSpec, WELFORD_PARTS, render as render_rows
from .... import dtypes
from ....errors import UnsupportedError
from ....runtime.autotune import TuningRecord
from ..heuristics import rows as row_heuristics
from ..heuristics.rows import (PackedDims, RowConfig, RowSchedule, RowTraits, combine_blocks, fused_norm_backward,
                               geometry as row_geometry, is_column_split, row_problem,
                               schedule as schedule_rows)
from ....runtime.launch import kernel_name, launch_of, sample_tensors, scratch, time_candidate
from ....symbolic import top_dims, top_strides

# The split combine kernel folds [SPLITS, BLOCK_K] partials: a few hundred values per program.
COMBINE_WARPS = 4

KIND_OF_SPAN = {(True, True): "tile", (True, False): "row", (False, True): "col", (False, False): "scalar"}


def _row_kinds(problem, group, tile_outputs=()) -> dict:
    """uid -> 'tile' | 'row' | 'col' | 'scalar' for every tensor a row group touches.

    A tensor spans a side (kept K, reduced R) when it walks an axis of size > 1 there; its size-1
    axes say nothing, so spans are also inherited: the anchor's element outputs (`tile_outputs`,
    from the recipe) span R, and a fused node's output spans what its operands span. Otherwise a
    softmax over an axis of size 1 would be taken for a row output and never stored.
    """
    spans = {}
    for tensor in group.inputs:
        spans[tensor.uid] = _strided_span(problem, tensor)
    for node in group.nodes:
        inherited = [spans.get(t.uid, (False, False)) for t in node.input_tensors()]
        for tensor in node.output_tensors():
            over_k, over_r = _strided_span(problem, tensor)
            if node is not group.anchor:
                over_k = over_k or any(k for k, _ in inherited)
                over_r = over_r or any(r for _, r in inherited)
            elif tensor.uid in tile_outputs:
                over_r = True
            spans[tensor.uid] = (over_k, over_r)
    return {uid: KIND_OF_SPAN[span] for uid, span in spans.items()}


def _strided_span(problem, tensor) -> tuple:
    """(walks a kept axis, walks a reduced axis) of size > 1."""
    strides = problem.strides(tensor)
    over_r = any(s for a, s in enumerate(strides) if a in problem.reduced_axes)
    over_k = any(s for a, s in enumerate(strides) if a not in problem.reduced_axes)
    return over_k, over_r


def _row_launch(spec, programs, num_warps, scratch_buffers=()):
    source = render_rows(spec)
    cfg, geo = spec.schedule.config, spec.schedule.geometry
    config_text = (f"{spec.shape} ({cfg.mode}) BLOCK_K={cfg.block_k} BLOCK_R={cfg.block_r} "
                   f"SPLITS={cfg.splits} num_warps={num_warps} grid={programs} "
                   f"K={list(geo.k_sizes)} R={list(geo.r_sizes)}" + (" int64-index" if geo.index_64 else ""))
    return launch_of(spec.group, source, programs, num_warps, config_text, spec.schedule.reason,
                     scratch=scratch_buffers, fp_fusion=spec.recipe.fp_fusion)


def _row_launches(graph, group, name, problem, recipe_of, stores, context, epilogue=None):
    """The launches of one row problem: one kernel, or partial + combine (+ apply) when split;
    the model's config (or the options' forced mode or config), or with the context's tuner the
    fastest of its top candidates, within the workspace budget. `epilogue`: the group's
    epilogue nodes these kernels run (None: all)."""
    tuner, budget, options = context.tuner, context.budget, context.options
    recipe = recipe_of(group.anchor, _row_kinds(problem, group))
    kinds = _row_kinds(problem, group, tuple(recipe.tile_outputs))
    tensors = list(group.inputs) + [t for t in group.outputs if t.uid in stores]
    operands = [(t.uid, t.data_type, problem.strides(t), t.uid in stores) for t in tensors]
    main = next((i for i, t in enumerate(group.inputs) if kinds[t.uid] == "tile"), 0)
    geo = row_geometry(problem.domain, problem.reduced_axes, operands, main)
    # the config is chosen at the top of the bucket a dynamic graph was specialised at (the
    # same for every size of it); the kernel runs this size's geometry
    top_geo = _geometry_at_top(graph, group.anchor, tensors, stores, main) if getattr(graph, "bucket", None) else geo
    tile_stores = tuple(u for u in stores if kinds[u] in ("tile", "col"))
    row_stores = tuple(u for u in stores if u not in tile_stores)
    tile_inputs = sum(kinds[t.uid] in ("tile", "col") for t in group.inputs)
    col_bytes = sum(t.data_type.itemsize for t in group.inputs if kinds[t.uid] == "col")
    traits = RowTraits(len(recipe.stages_for("looped")), bool(tile_stores), recipe.splittable,
                       recipe.live_tiles, tile_inputs, group.anchor.op, col_bytes=col_bytes)
    bytes_of = lambda wanted: sum(t.data_type.itemsize for t in tensors if kinds[t.uid] in wanted)
    sched = schedule_rows(top_geo, traits, bytes_of(("tile", "col")) or 4, bytes_of(("row", "scalar")),
                          context.target, options.row_mode, options.row_config, options.row_loop_tile,
                          options.row_split_min_reduced)
    scratch_of = lambda c: split_scratch_bytes(c, geo, recipe, tile_stores)
    fits = lambda c: budget is None or budget.allows(split_scratch_bytes(c, top_geo, recipe, tile_stores))
    ranked = [c for c in sched.ranked if fits(c)]
    if not ranked:  # only where a test forced the split mode: every real ranking has unsplit configs
        raise UnsupportedError(f"node {group.anchor.name!r}: no row config fits the workspace limit")
    if ranked[0] is not sched.config:
        skipped = sched.ranked.index(ranked[0])
        sched = replace(sched, config=ranked[0], reason=f"model rank {skipped + 1} of {len(sched.ranked)}: the "
                                                        f"{skipped} ranked above need more workspace than the limit")
    record = TuningRecord("model", sched.config.text)
    sched = replace(sched, geometry=_for_every_size(geo, top_geo))
    build = lambda chosen: _row_schedule_launches(graph, group, name, chosen, recipe, stores, kinds,
                                                  tile_stores, row_stores, options, epilogue)
    if tuner is not None:
        device = context.device
        tensors = sample_tensors(group, device)
        config, record = tuner.choose(
            "rows", f"{group.anchor.op} {sched.signature(traits)}" + _limit_text(budget), ranked, RowConfig.to_record,
            RowConfig.from_record, lambda c: c.text,
            lambda c: time_candidate(build(replace(sched, config=c)), tensors, device))
        sched = replace(sched, config=config, reason=record.describe() or sched.reason)
    if budget is not None:
        budget.spend(scratch_of(sched.config))
        sched = replace(sched, reason=sched.reason + "; " + budget.describe(scratch_of(sched.config)))
    launches = build(sched)
    for launch in launches:
        launch.tuning = record
    return launches


@dataclass(frozen=True)
class _AtTop:
    """A tensor with its dims and strides at the bucket's top (symbolic.BucketExtents), for
    choosing a config there; anything else is the tensor's own."""

    tensor: object
    dim: tuple
    stride: tuple

    def __getattr__(self, name):
        return getattr(self.tensor, name)


def at_bucket_top(graph, tensor) -> _AtTop:
    """`tensor` as the top of the bucket `graph` was specialised at has it (see _AtTop)."""
    return _AtTop(tensor, top_dims(graph, tensor), top_strides(graph, tensor))


def _geometry_at_top(graph, anchor, tensors: list, stores: list, main: int, static=()):
    """The row geometry of `anchor` over `tensors` (and `static`: (uid, type, tensor, stored) of
    operands whose dims never vary) at the top of the bucket `graph` was specialised at."""
    at_top = SimpleNamespace(op=anchor.op, opdef=anchor.opdef, attrs=anchor.attrs,
                             inputs=[None if t is None else at_bucket_top(graph, t) for t in anchor.inputs])
    problem = row_problem(at_top)
    operands = [(t.uid, t.data_type, problem.strides(at_bucket_top(graph, t)), t.uid in stores) for t in tensors]
    operands += [(uid, data_type, problem.strides(tensor), stored) for uid, data_type, tensor, stored in static]
    return row_geometry(problem.domain, problem.reduced_axes, operands, main)


def _for_every_size(geo, top_geo):
    """`geo` (this size's) with what its kernel's source bakes in taken so that it holds at every
    size of the bucket: int64 offsets where the top needs them, one tile per row only where
    the top's rows fit one (its reduced length)."""
    if top_geo is geo:
        return geo
    return replace(geo, index_64=geo.index_64 or top_geo.index_64, source_reduced=top_geo.reduced)


def _partial_names(recipe) -> list:
    """The split partials of a recipe: one per accumulator (a Welford statistic has parts); none
    for a recipe without a reduction (batchnorm_inference), which never splits."""
    stages = recipe.stages_for("split")
    if not stages:
        return []
    (accumulators, _), = stages
    return [f"{a.name}_{p}" if a.combine == "welford" else a.name
            for a in accumulators for p in (WELFORD_PARTS if a.combine == "welford" else ("",))]


def split_scratch_bytes(config, geo, recipe, tile_stores) -> int:
    """Workspace a row config adds: split partials [SPLITS, rows] and the stash the apply reads."""
    if config.mode != "split":
        return 0
    partials = len(_partial_names(recipe)) * config.splits * geo.rows * PARTIAL_TYPES[recipe.kind].itemsize
    return partials + (len(recipe.stash) * geo.rows * 4 if tile_stores else 0)


def _limit_text(budget) -> str:
    """The workspace limit as part of a tuning key (configs over it are not candidates)."""
    return "" if budget is None or budget.limit is None else f" ws{budget.limit}"


def _row_schedule_launches(graph, group, name, sched, recipe, stores, kinds, tile_stores, row_stores, options,
                           epilogue=None):
    cfg, geo = sched.config, sched.geometry
    common = dict(schedule=sched, recipe=recipe, group=group, kinds=kinds,
                  loads=_row_loads(group, epilogue), compute=graph.compute_data_type.triton_type,
                  description=group.summary(), epilogue=epilogue)
    if cfg.mode == "persistent":  # programs walk row blocks, the next ones' loads in flight
        spec = RowKernelSpec(name, "persistent", stores=tuple(stores),
                             prefetch=row_heuristics.fused_prefetch(cfg, geo), **common)
        return [_row_launch(spec, sched.programs, cfg.num_warps)]
    if cfg.mode != "split":
        spec = RowKernelSpec(name, "main", stores=tuple(stores), **common)
        return [_row_launch(spec, sched.programs, cfg.num_warps)]
    partials = {n: scratch((cfg.splits, geo.rows), PARTIAL_TYPES[recipe.kind]) for n in _partial_names(recipe)}
    stash = {n: scratch((geo.rows,)) for n in recipe.stash} if tile_stores else {}
    column = is_column_split(geo, cfg)
    prefetch = options.column_prefetch_tiles if column else 0
    combine_k, split_tile = combine_blocks(geo.rows, cfg.splits, options.row_combine_values)
    combine_common = dict(common, schedule=replace(sched, config=replace(cfg, block_k=combine_k,
                                                                          num_warps=COMBINE_WARPS)))
    launches = [
        _row_launch(RowKernelSpec(name + "_partial", "partial", stores=(), prefetch=prefetch,
                                  partials={n: s.uid for n, s in partials.items()}, **common),
                    sched.programs, cfg.num_warps, partials.values()),
        _row_launch(RowKernelSpec(name + "_combine", "combine", stores=row_stores,
                                  partials={n: s.uid for n, s in partials.items()},
                                  stash={n: s.uid for n, s in stash.items()}, split_tile=split_tile,
                                  **combine_common),
                    -(-geo.rows // combine_k), COMBINE_WARPS, stash.values())]
    if tile_stores:
        stream = column and options.column_stream_apply
        launches.append(_row_launch(RowKernelSpec(name + "_apply", "apply", stores=tile_stores, prefetch=prefetch,
                                                  reverse=stream, streaming=stream,
                                                  stash={n: s.uid for n, s in stash.items()}, **common),
                                    sched.programs, cfg.num_warps))
    return launches


def _row_loads(group, epilogue) -> tuple:
    """uids of the group inputs a row kernel reads: all, but those only skipped epilogue nodes read."""
    if epilogue is None:
        return tuple(t.uid for t in group.inputs)
    running = [n for n in group.nodes if n not in group.epilogue or n in epilogue]
    read = {t.uid for n in running for t in n.input_tensors()}
    return tuple(t.uid for t in group.inputs if t.uid in read)


# split partials hold the accumulator's type: integer sums and products stay exact in int64
PARTIAL_TYPES = {"f": torch.float32, "l": torch.int64}


def require_floating_inputs(anchor, tensors=None):
    """Row and pooling kernels accumulate in floating point: integer inputs would be rounded, but
    8-bit ones (int8, uint8: quantized activations), which float32 holds exactly, are computed on
    as their float values are. `tensors`: the anchor inputs that are accumulated (default: all)."""
    for tensor in anchor.input_tensors() if tensors is None else tensors:
        if not tensor.data_type.is_floating and not dtypes.is_saturating(tensor.data_type):
            raise UnsupportedError(
                f"node {anchor.name!r} ({anchor.op}) reads {tensor.name!r} of type {tensor.data_type.name}: "
                f"its kernel computes in floating point and would round integers; cast the input to a "
                f"floating type first")


def build_rows(graph, group, context):
    """Reductions, softmax and norms; norm backward adds a kernel for dscale/dbias unless they
    are per-row sums of the dx kernel (batchnorm) or column sums of it (the fused form)."""
    anchor, name = group.anchor, kernel_name(group)
    if anchor.op != "reduction":  # the reduction recipe accumulates integers in int64
        require_floating_inputs(anchor)
    problem = row_problem(anchor)
    stores = [t.uid for t in group.outputs]
    if anchor.opdef.family == "norm" and anchor.op.endswith("_backward"):
        # by the scale's dims, not its strides: an expanded scale is still one parameter per index
        scale_extent = problem.extent(anchor.inputs[2])
        kept = [a for a, size in enumerate(problem.domain) if a not in problem.reduced_axes and size > 1]
        per_row = all(scale_extent[a] for a in kept) and not any(scale_extent[a] for a in problem.reduced_axes)
        if not per_row:  # dscale is not one value per dx row
            return _norm_backward_launches(graph, group, name, problem, scale_extent, stores, context)
    return _row_launches(graph, group, name, problem, RECIPES[anchor.op], stores, context)


def _parameter_side(group) -> set:
    """uids of dscale, dbias and the epilogue values made from them (side epilogues)."""
    side = {t.uid for t in group.anchor.outputs[1:] if t is not None}
    for node in group.epilogue:
        if any(t.uid in side for t in node.input_tensors()):
            side |= {t.uid for t in node.output_tensors()}
    return side


def _norm_backward_launches(graph, group, name, problem, scale_extent, stores, context):
    """dx, dscale and dbias where dscale sums over dx rows: the fused kernel and a combine, or
    the dx kernel and a dscale/dbias kernel of its own. The epilogue nodes made from dx run in
    the dx kernel, those made from dscale or dbias where those are finished."""
    param_side = _parameter_side(group)
    dx_epilogue = tuple(n for n in group.epilogue if n.outputs[0].uid not in param_side)
    param_epilogue = tuple(n for n in group.epilogue if n.outputs[0].uid in param_side)
    dx_stores = [u for u in stores if u not in param_side]
    param_stores = [u for u in stores if u in param_side]
    param_problem = problem.with_reduced(a for a, spans in enumerate(scale_extent) if not spans)
    kept = [a for a, size in enumerate(problem.domain) if a not in problem.reduced_axes and size > 1]
    reduced = [a for a in problem.reduced_axes if problem.domain[a] > 1]
    # one parameter per column (layernorm, rmsnorm): column sums over every row; a scale constant
    # along a reduced axis (groupnorm of one group) would sum columns as well
    # a forced row config, or a forced mode other than "fused", runs the separate kernels
    options = context.options
    fusable = options.row_config is None and options.row_mode in (None, "fused")
    if fusable and not any(scale_extent[a] for a in kept) and all(scale_extent[a] for a in reduced):
        fused = _fused_norm_backward(graph, group, name, problem, param_problem, dx_stores, param_stores,
                                     dx_epilogue, param_epilogue, context)
        if fused is not None:
            return fused
    return (_row_launches(graph, group, name, problem, RECIPES[group.anchor.op], dx_stores, context,
                          epilogue=dx_epilogue)
            + _row_launches(graph, group, name + "_params", param_problem, norm_parameter_grads, param_stores,
                            context, epilogue=param_epilogue))


def _inputs_read(group, nodes) -> list:
    """The group inputs that `nodes` read, in group order."""
    read = {t.uid for n in nodes for t in n.input_tensors()}
    return [t for t in group.inputs if t.uid in read]


def _fused_norm_backward(graph, group, name, problem, param_problem, dx_stores, param_stores, dx_epilogue,
                         param_epilogue, context):
    """The fused kernel (dx, and dscale/dbias partials per program) and the combine of the
    partials, or None where heuristics/rows.py says the fused form does not apply (or its
    partials do not fit the workspace limit); with `tuner`, the fastest of a few program and
    warp counts."""
    anchor, tuner, budget, options = group.anchor, context.tuner, context.budget, context.options
    recipe = RECIPES[anchor.op](anchor, _row_kinds(problem, group))
    kinds = _row_kinds(problem, group, tuple(recipe.tile_outputs))
    param_recipe = norm_parameter_grads(anchor, _row_kinds(param_problem, group))
    (param_accumulators, _), = param_recipe.stages
    # the partials' column is the parameters' row-major index: a stand-in operand with those
    # strides joins both geometries, so their merged axes keep it and each kernel has its strides
    column = PackedDims(tuple(anchor.inputs[2].dim))
    column_uid = -1  # the stand-in's uid: the other operands are graph tensors (uids from 0 up)
    dx_reads = _inputs_read(group, [n for n in group.nodes if n not in group.epilogue] + list(dx_epilogue))
    tensors = dx_reads + [t for t in group.outputs if t.uid in dx_stores]
    operands = [(t.uid, t.data_type, problem.strides(t), t.uid in dx_stores) for t in tensors]
    main = next((i for i, t in enumerate(tensors) if kinds[t.uid] == "tile"), 0)
    geo = row_geometry(problem.domain, problem.reduced_axes,
                       operands + [(column_uid, None, problem.strides(column), True)], main)
    bytes_main = sum(t.data_type.itemsize for t in tensors if kinds[t.uid] in ("tile", "col"))
    # chosen at the top of the bucket a dynamic graph was specialised at (programs past this
    # size's rows find none and store zero partials); the kernels run this size's geometry
    top_geo = geo if getattr(graph, "bucket", None) is None else _geometry_at_top(
        graph, anchor, tensors, dx_stores, main, [(column_uid, None, column, True)])
    config = fused_norm_backward(top_geo, len(param_accumulators), bytes_main, context.target,
                                 options.norm_backward_programs, options.norm_backward_max_reduced)
    if config is None:
        return None
    geo = _for_every_size(geo, top_geo)
    partial_bytes = lambda c: len(param_accumulators) * c.splits * top_geo.reduced * 4
    ranked = [c for c in row_heuristics.fused_candidates(config, top_geo.rows, context.target)
              if budget is None or budget.allows(partial_bytes(c))]
    if not ranked:
        return None
    param_reads = _inputs_read(group, param_epilogue)
    param_tensors = param_reads + [t for t in group.outputs if t.uid in param_stores]
    param_operands = [(t.uid, t.data_type, param_problem.strides(t), t.uid in param_stores)
                      for t in param_tensors]
    column_at = len(param_operands)  # the partials' order leads: stores of a few values each
    param_geo = row_geometry(param_problem.domain, param_problem.reduced_axes,
                             param_operands + [(column_uid, None, param_problem.strides(column), True)], column_at)
    common = dict(group=group, compute=graph.compute_data_type.triton_type, description=group.summary())

    def build(chosen, reason):
        partials = {acc.name: scratch((chosen.splits, geo.reduced)) for acc in param_accumulators}
        part_uids = {n: p.uid for n, p in partials.items()}
        fused_spec = RowKernelSpec(name, "fused", RowSchedule(geo, chosen, len(ranked), reason), recipe=recipe,
                                   kinds=kinds, loads=tuple(t.uid for t in dx_reads), stores=tuple(dx_stores),
                                   epilogue=dx_epilogue, partials=part_uids,
                                   param_accumulators=tuple(param_accumulators),
                                   prefetch=row_heuristics.fused_prefetch(chosen, geo),
                                   prime_next_rows=row_heuristics.FUSED_LOOP_PRIME_NEXT_ROWS,
                                   part_strides=geo.operand(column_uid).r_strides, **common)
        combine_k, split_tile = combine_blocks(param_geo.rows, chosen.splits, options.row_combine_values)
        combine_config = RowConfig("fused", combine_k, 1, COMBINE_WARPS, chosen.splits, 0.0)
        combine_spec = RowKernelSpec(name + "_combine", "combine",
                                     RowSchedule(param_geo, combine_config, 1, reason + "; partials summed in "
                                                                                       "program order"),
                                     recipe=param_recipe, kinds=_row_kinds(param_problem, group),
                                     loads=tuple(t.uid for t in param_reads), stores=tuple(param_stores),
                                     epilogue=param_epilogue, partials=part_uids, split_tile=split_tile,
                                     part_strides=param_geo.operand(column_uid).k_strides, **common)
        return [_row_launch(fused_spec, chosen.splits, chosen.num_warps, partials.values()),
                _row_launch(combine_spec, -(-param_geo.rows // combine_k), COMBINE_WARPS)]

    chosen = ranked[0]
    walk = "" if chosen.block_r >= top_geo.reduced else f" walking rows in chunks of {chosen.block_r}"
    reason = (f"fused dx + dscale/dbias: {chosen.splits} programs of contiguous row blocks{walk}, "
              f"{chosen.estimate_us:.1f} us by the model for K={top_geo.rows} rows x R={top_geo.reduced}")
    record = TuningRecord("model", _fused_text(chosen))
    if tuner is not None:
        device = context.device
        samples = sample_tensors(group, device)
        signature = f"{anchor.op} fused K{top_geo.k_sizes} R{top_geo.r_sizes} {bytes_main}B" + _limit_text(budget)
        chosen, record = tuner.choose("rows", signature, ranked, RowConfig.to_record,
                                      row_heuristics.fused_from_record, _fused_text,
                                      lambda c: time_candidate(build(c, reason), samples, device))
        reason = record.describe() or reason
    if budget is not None:
        budget.spend(partial_bytes(chosen))
        reason += "; " + budget.describe(partial_bytes(chosen))
    launches = build(chosen, reason)
    for launch in launches:
        launch.tuning = record
    return launches


def _fused_text(config) -> str:
    return (f"fused programs={config.splits} BLOCK_K={config.block_k} BLOCK_R={config.block_r} "
            f"warps={config.num_warps}")
