"""What a row kernel computes, per op: statistics over R, then values per row and per element.

A recipe is plain data rendered by codegen/rows.py. Templates name the anchor's inputs by role
(`{x}`, `{dy}`, `{scale}`: the value after any fused prologue) and refer to row statistics by
their plain names (`mean`, `inv`), which are [BLOCK_K, 1] values; `n_reduced` is the number of
reduced elements as float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ....errors import UnsupportedError


@dataclass(frozen=True)
class Accumulator:
    name: str  # the row value it produces (welford: name_count, name_mean, name_m2)
    combine: str  # "sum", "max", "min", "prod" or "welford"
    element: str  # template of the per-element value
    kind: str = "f"  # "f": accumulates in the compute float; "l": in int64 (exact, wrapping)


@dataclass
class Recipe:
    roles: dict  # role -> input uid (present inputs only)
    stages: list  # list of (accumulators, finalize lines); one statistics pass per stage
    tile_outputs: dict = field(default_factory=dict)  # output uid -> element template
    row_outputs: dict = field(default_factory=dict)  # output uid -> row template
    # single-stage form for the looped and split modes (None: use `stages`; not splittable)
    single: tuple | None = None
    live_tiles: int = 1
    # row statistics the tile outputs read (stored between the split kernels)
    stash: tuple = ()
    # the kind its roles are read in and its row outputs hold: "f" (compute float) or "l" (int64)
    kind: str = "f"
    # False where the element outputs subtract terms that are equal in exact arithmetic: an FMA
    # would round one side and not the other (norm backward over a one-element group gave
    # rsqrt(eps)-amplified noise instead of 0 on the H100)
    fp_fusion: bool = True

    def stages_for(self, mode: str) -> list:
        """Statistics stages the kernel of `mode` runs."""
        if mode in ("looped", "split") and self.single is not None:
            return [self.single]
        return self.stages

    def statistic_names(self) -> tuple:
        """(stems, names) of the identifiers the recipe's statements introduce: each
        accumulator's name is a stem (its lanes, tiles and parts are `name_*`), each finalize
        line assigns one name. The kernel's allocator reserves them all."""
        stages = list(self.stages) + ([self.single] if self.single is not None else [])
        stems = {acc.name for accumulators, _ in stages for acc in accumulators}
        assigned = {line.split("=", 1)[0].strip() for _, finalize in stages for line in finalize}
        return tuple(sorted(stems)), tuple(sorted(assigned | set(self.stash)))

    @property
    def splittable(self) -> bool:
        return self.single is not None or len(self.stages) == 1  # no statistics: nothing to split


def _roles(node) -> dict:
    return {name: t.uid for name, t in zip(node.opdef.input_names, node.inputs) if t is not None}


def _outputs(node) -> dict:
    return {name: t.uid for name, t in zip(node.opdef.output_names, node.outputs) if t is not None}


# --- reduction ----------------------------------------------------------------------------------
_REDUCTION = {  # mode -> (combine, element, result)
    "sum": ("sum", "{x}", "acc"),
    "mean": ("sum", "{x}", "acc / n_reduced"),
    "max": ("max", "{x}", "acc"),
    "min": ("min", "{x}", "acc"),
    "amax": ("max", "tl.abs({x})", "acc"),
    "prod": ("prod", "{x}", "acc"),
    "norm1": ("sum", "tl.abs({x})", "acc"),
    "norm2": ("sum", "{x} * {x}", "tl.sqrt_rn(acc)"),
}


# modes torch defines on integer and bool tensors (mean and the norms ask for a float input);
# amax is abs then max, exact on integers, and on bools the max itself
INTEGER_MODES = ("sum", "prod", "max", "min", "amax")


def reduction(node, kinds) -> Recipe:
    mode, x = node.attrs.mode, node.inputs[0]
    combine, element, result = _REDUCTION[mode]
    kind = "f" if x.data_type.is_floating else "l"
    if kind == "l" and mode not in INTEGER_MODES:
        raise UnsupportedError(
            f"node {node.name!r} (reduction {mode}) reads {x.name!r} of type {x.data_type.name}: "
            f"{mode} is defined on floating inputs only (as in torch); integer inputs support "
            f"{', '.join(INTEGER_MODES)}; cast the input to a floating type first")
    stage = ([Accumulator("acc", combine, element, kind)], [])
    return Recipe(_roles(node), [stage], row_outputs={node.outputs[0].uid: result}, kind=kind)


# --- softmax ------------------------------------------------------------------------------------
def softmax(node, kinds) -> Recipe:
    stages = [([Accumulator("row_max", "max", "{x}")], []),
              ([Accumulator("row_sum", "sum", "tl.exp({x} - row_max)")], [])]
    y = ("({x} - row_max) - tl.log(row_sum)" if node.attrs.log
         else "tl.exp({x} - row_max) / row_sum")
    return Recipe(_roles(node), stages, {node.outputs[0].uid: y}, live_tiles=2)


def softmax_backward(node, kinds) -> Recipe:
    if node.attrs.log:  # dx = dy - softmax(x) * sum(dy), softmax(x) = exp(y)
        stage = ([Accumulator("dot", "sum", "{dy}")], [])
        dx = "{dy} - tl.exp({y}) * dot"
    else:  # dx = y * (dy - sum(dy * y))
        stage = ([Accumulator("dot", "sum", "{dy} * {y}")], [])
        dx = "{y} * ({dy} - dot)"
    return Recipe(_roles(node), [stage], {node.outputs[0].uid: dx}, live_tiles=3, stash=("dot",))


# --- normalization forward ----------------------------------------------------------------------
def _affine(roles, normalized: str) -> str:
    value = f"{normalized} * {{scale}}"
    return value + (" + {bias}" if "bias" in roles else "")


def _epsilon(node, roles) -> str:
    """The norm's epsilon: its one-element tensor operand where given, else the attribute."""
    return "{epsilon}" if "epsilon" in roles else repr(float(node.attrs.epsilon))


def _statistics_outputs(node, outs, eps) -> dict:
    rows = {}
    if "mean" in outs:
        rows[outs["mean"]] = "mean"
    if "inv_variance" in outs:
        rows[outs["inv_variance"]] = "inv"
    # batchnorm's momentum: its one-element tensor operand where given, else the attribute
    momentum = "{momentum}" if "momentum" in _roles(node) else repr(float(node.attrs.momentum))
    if "next_running_mean" in outs:
        rows[outs["next_running_mean"]] = f"(1.0 - {momentum}) * {{in_running_mean}} + {momentum} * mean"
    if "next_running_var" in outs:
        rows[outs["next_running_var"]] = (f"(1.0 - {momentum}) * {{in_running_var}} + {momentum} * "
                                          f"var * n_reduced / tl.maximum(n_reduced - 1.0, 1.0)")
    return rows


def centered_norm(node, kinds) -> Recipe:
    """layernorm, batchnorm, instancenorm, groupnorm forward."""
    roles, outs = _roles(node), _outputs(node)
    eps = _epsilon(node, roles)
    inv = f"inv = tl.rsqrt(var + {eps})"
    # the second pass also sums the deviations: the mean is rounded to fp32, and the square of
    # what that rounding leaves (sum of deviations / n) is taken back out (the corrected two-pass
    # variance; at mean 1e4 and spread 1e-2 the plain form was 5e-3 off in fp32)
    stages = [([Accumulator("row_sum", "sum", "{x}")], ["mean = row_sum / n_reduced"]),
              ([Accumulator("sq_dev", "sum", "({x} - mean) * ({x} - mean)"), Accumulator("dev", "sum", "{x} - mean")],
               ["var = tl.maximum(sq_dev - dev * dev / n_reduced, 0.0, propagate_nan=tl.PropagateNan.ALL) / n_reduced", inv])]
    single = ([Accumulator("stats", "welford", "{x}")],
              ["mean = stats_mean", "var = stats_m2 / n_reduced", inv])
    y = _affine(roles, "({x} - mean) * inv")
    return Recipe(roles, stages, {outs["y"]: y}, _statistics_outputs(node, outs, eps), single,
                  live_tiles=2, stash=("mean", "inv"))


def rmsnorm(node, kinds) -> Recipe:
    roles, outs = _roles(node), _outputs(node)
    stage = ([Accumulator("sq_sum", "sum", "{x} * {x}")],
             [f"inv = tl.rsqrt(sq_sum / n_reduced + {_epsilon(node, roles)})"])
    rows = {outs["inv_variance"]: "inv"} if "inv_variance" in outs else {}
    return Recipe(roles, [stage], {outs["y"]: _affine(roles, "{x} * inv")}, rows, stash=("inv",))


def genstats(node, kinds) -> Recipe:
    outs = _outputs(node)
    stage = ([Accumulator("total", "sum", "{x}"), Accumulator("sq_total", "sum", "{x} * {x}")], [])
    return Recipe(_roles(node), [stage], row_outputs={outs["sum"]: "total", outs["sq_sum"]: "sq_total"})


def batchnorm_inference(node, kinds) -> Recipe:
    y = "({x} - {mean}) * {inv_variance} * {scale} + {bias}"
    return Recipe(_roles(node), [], {node.outputs[0].uid: y})


# --- normalization backward ---------------------------------------------------------------------
def _xhat(op) -> str:
    return "{x} * {inv_variance}" if op == "rmsnorm_backward" else "({x} - {mean}) * {inv_variance}"


def norm_backward(node, kinds) -> Recipe:
    """dx (and dscale, dbias where they are per-row sums of this kernel, as in batchnorm)."""
    if kinds.get(_outputs(node)["dscale"]) in ("row", "scalar"):  # one value per dx row (plan.py decides)
        return _norm_backward_per_row(node)
    roles, outs = _roles(node), _outputs(node)
    xhat, g = _xhat(node.op), "{dy} * {scale}"
    centered = node.op != "rmsnorm_backward"
    accumulators = [Accumulator("g_xhat", "sum", f"{g} * {xhat}")]
    correction = f"{xhat} * g_xhat"
    if centered:
        accumulators.append(Accumulator("g_sum", "sum", g))
        correction = f"(g_sum + {correction})"
    dx = f"{{inv_variance}} * ({g} - {correction} / n_reduced)"
    stash = ("g_xhat", "g_sum") if centered else ("g_xhat",)
    return Recipe(roles, [(accumulators, [])], {outs["dx"]: dx}, {}, live_tiles=4, stash=stash,
                  fp_fusion=False)


def _norm_backward_per_row(node) -> Recipe:
    """Scale constant along each row (batchnorm): sum(g * xhat) and sum(g) are scale times
    dscale and dbias, so two sums serve dx and the parameter gradients alike, and the row
    factors (sums over n, inv * scale) are formed once per row, not per element."""
    roles, outs = _roles(node), _outputs(node)
    xhat = _xhat(node.op)
    centered = node.op != "rmsnorm_backward"
    accumulators = [Accumulator("dscale_sum", "sum", f"{{dy}} * {xhat}")]
    rows = {outs["dscale"]: "dscale_sum"}
    correction = f"{xhat} * (dscale_sum / n_reduced)"
    if centered or "dbias" in outs:
        accumulators.append(Accumulator("dbias_sum", "sum", "{dy}"))
    if "dbias" in outs:
        rows[outs["dbias"]] = "dbias_sum"
    if centered:
        correction = f"(dbias_sum / n_reduced + {correction})"
    dx = f"({{inv_variance}} * {{scale}}) * ({{dy}} - {correction})"
    stash = ("dscale_sum", "dbias_sum") if centered else ("dscale_sum",)
    return Recipe(roles, [(accumulators, [])], {outs["dx"]: dx}, rows, live_tiles=3, stash=stash,
                  fp_fusion=False)


def norm_parameter_grads(node, kinds) -> Recipe:
    """dscale and dbias as their own reduction over everything but the parameter axes."""
    roles, outs = _roles(node), _outputs(node)
    accumulators = [Accumulator("dscale_sum", "sum", f"{{dy}} * {_xhat(node.op)}")]
    rows = {outs["dscale"]: "dscale_sum"}
    if "dbias" in outs:
        accumulators.append(Accumulator("dbias_sum", "sum", "{dy}"))
        rows[outs["dbias"]] = "dbias_sum"
    return Recipe(roles, [(accumulators, [])], row_outputs=rows, live_tiles=3)


RECIPES = {
    "reduction": reduction,
    "softmax": softmax,
    "softmax_backward": softmax_backward,
    "layernorm": centered_norm,
    "batchnorm": centered_norm,
    "instancenorm": centered_norm,
    "groupnorm": centered_norm,
    "rmsnorm": rmsnorm,
    "genstats": genstats,
    "batchnorm_inference": batchnorm_inference,
    "layernorm_backward": norm_backward,
    "batchnorm_backward": norm_backward,
    "instancenorm_backward": norm_backward,
    "groupnorm_backward": norm_backward,
    "rmsnorm_backward": norm_backward,
    "adalayernorm": centered_norm,  # layernorm whose scale and bias may be per sample
    "adalayernorm_backward": norm_backward,
}
