"""The Triton backend (triton.language) behind the backend contract (backends/contract.py):
every family, every GPU, and CPU tensors through Triton's interpreter.

lower() runs today's builder of the group's family (lower/<family>.py), which chooses its config
(the heuristics' ranking, the options' forced configs, or autotuning through the context's
tuner), renders, loads and returns the launches. candidates() and estimate() expose the
heuristics' ranking on the backend-neutral problem where a family has one (matmul, conv fprop,
pointwise, pooling, sdpa forward); elsewhere one candidate stands for the builder's own choice.
The ranking from a neutral problem leaves out what only the fused group shows (TMA legality,
epilogue bytes): lower() decides with the group itself, exactly as before.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Union

import triton

from ...dtypes import DataType
from ...problems import Problem
from ...problems.attention import forward_shape_class, forward_work
from ...target import Target
from ...versions import __version__
from ..contract import Candidate
from .codegen.pooling import prologue_values_to_store
from .heuristics import conv as conv_heuristics
from .heuristics import conv_measured
from .heuristics import matmul as matmul_heuristics
from .heuristics import pointwise as pointwise_heuristics
from .heuristics import pooling as pooling_heuristics
from .heuristics import sdpa as sdpa_heuristics
from .heuristics.layout import iteration_space, operand_strides
from .lower.attention import build_attention_backward
from .lower.conv import build_conv
from .lower.ctc import build_ctc
from .lower.gather import build_gather
from .lower.lrn import build_lrn
from .lower.block_scale import build_block_scale
from .lower.matmul import build_matmul
from .lower.moe import build_moe
from .lower.pointwise import build_pointwise
from .lower.pooling import build_pooling
from .lower.rows import build_rows
from .lower.rnn import build_rnn
from .lower.sdpa import build_attention, build_sdpa
from .lower.sdpa_fp8 import build_sdpa_fp8

# group kind -> builder(graph, group, context) -> KernelLaunch or a list of them
BUILDERS = {"pointwise": build_pointwise, "copy": build_pointwise, "reduction": build_rows, "softmax": build_rows,
            "norm": build_rows, "pooling": build_pooling, "matmul": build_matmul,
            "conv": build_conv, "sdpa": build_sdpa, "attention": build_attention,
            "attention_backward": build_attention_backward, "gather": build_gather,
            "moe": build_moe,
            "ctc": build_ctc, "lrn": build_lrn,
            "block_scale": build_block_scale}
BUILDERS["rnn"] = build_rnn
BUILDERS["sdpa_fp8"] = build_sdpa_fp8

# Families whose loads may visit an input element several times (or never): prologue values that
# are outputs are written first by a pointwise kernel of the prologue.
PROLOGUE_STORED_APART = frozenset({"pooling", "matmul", "conv", "lrn", "block_scale"})


def _dot(a: DataType, b: DataType, allow_tf32: bool) -> Optional[str]:
    if not (a.is_floating and b.is_floating):
        return None
    return matmul_heuristics.choose_dot(a.name, b.name, a.triton_type, b.triton_type, allow_tf32).dot


def _output_bytes(problem: Problem) -> int:
    return max(1, sum(o.data_type.itemsize for o in problem.outputs))


# Families whose every store of a graph output goes through the emitter's store (blending there).
BLENDING_FAMILIES = frozenset({"pointwise", "copy", "matmul", "conv", "reduction", "softmax", "norm", "pooling"})


class TritonBackend:
    """The contract over lower/'s builders and heuristics/' models."""

    name = "triton"
    version = f"dnngraph {__version__}, triton {triton.__version__}"
    interpretable = True
    prologue_stored_apart = PROLOGUE_STORED_APART
    verified = True  # its kernels run in the GPU test suites: among the default backends

    def __init__(self, builders: Optional[dict] = None):
        self.builders = dict(BUILDERS if builders is None else builders)

    def forced_options(self, problem: Problem, options) -> tuple:
        """The BuildOptions fields set for `problem`'s family that force this backend's kernel
        (FORCED_OPTIONS): a build told to run one of its configs gets it, whatever another
        backend's model says (registry.supporting)."""
        return tuple(name for name in FORCED_OPTIONS.get(problem.family, ())
                     if getattr(options, name) is not None and getattr(options, name) is not False)

    @property
    def families(self) -> frozenset:
        return frozenset(self.builders)

    def cache_key(self) -> tuple:
        return (self.name, self.version, self.interpretable, tuple(sorted(self.prologue_stored_apart)),
                tuple((kind, builder.__module__, builder.__qualname__, id(builder))
                      for kind, builder in sorted(self.builders.items())))

    def supports(self, problem: Problem, target: Target) -> Union[bool, str]:
        if problem.family not in self.builders:
            return f"no {problem.family} kernel exists yet"
        if problem.blended and problem.family not in BLENDING_FAMILIES:
            return f"its {problem.family} kernels store no blended output (Tensor.set_blend) yet"
        return True

    # -- the model's view of a neutral problem ---------------------------------------------------

    def _matmul_problem(self, problem: Problem) -> Optional[matmul_heuristics.MatmulProblem]:
        g, a, b = problem.geometry, problem.operand("a"), problem.operand("b")
        dot = _dot(a.data_type, b.data_type, g.allow_tf32) if a and b else None
        if dot is None:
            return None
        return matmul_heuristics.MatmulProblem(g.batch, g.m, g.n, g.k, dot, a.data_type.itemsize, b.data_type.itemsize,
                                               _output_bytes(problem), False, g.a_layout, g.b_layout,
                                               ",".join(problem.epilogue + problem.exits))

    def _conv_problem(self, problem: Problem) -> Optional[conv_heuristics.ConvProblem]:
        g = problem.geometry
        x, w = problem.operand("x"), problem.operand("w")
        if g.direction != "fprop" or x is None or w is None or g.c // g.groups == 1:
            return None  # dgrad and wgrad pose other GEMMs; depthwise convs take direct kernels
        dot = _dot(x.data_type, w.data_type, True)
        if dot is None:
            return None
        pixels = g.n
        for size in g.output_spatial:
            pixels *= size
        taps = 1
        for size in g.filter:
            taps *= size
        return conv_heuristics.ConvProblem(g.groups, pixels, g.k // g.groups, g.c // g.groups, taps, dot,
                                           x.data_type.itemsize, w.data_type.itemsize, _output_bytes(problem), "")

    def _conv_candidates(self, problem: Problem, posed, target: Target) -> list:
        """The conv model's ranked configs; where the forward's shape class was measured
        (heuristics/conv_measured.py), each estimate set to the measured rate's seconds times its
        model time over the first's (the level the registry compares with other backends')."""
        ranked = conv_heuristics.rank(posed, target)
        measured = conv_measured.measured_seconds(self.name, problem, target)
        if measured is None or not ranked:
            return [Candidate(self.name, c, c.estimate_us * 1e-6) for c in ranked]
        best = ranked[0].estimate_us
        return [Candidate(self.name, c, conv_measured.calibrated(c.estimate_us, best, measured)) for c in ranked]

    def _gradient_candidates(self, problem: Problem, target: Target) -> Optional[list]:
        """A conv the config model does not pose (dgrad, wgrad, depthwise): the builder's own
        choice, with the measured rate's seconds where the direction and shape class were measured
        (heuristics/conv_measured.py), else None (the default candidate)."""
        seconds = conv_measured.measured_seconds(self.name, problem, target)
        return None if seconds is None else [Candidate(self.name, None, seconds)]

    def _conv_seconds(self, problem: Problem, posed, config, target: Target) -> float:
        """A conv config's estimate as _conv_candidates gives it (the model's seconds outside a
        measured class)."""
        modeled = conv_heuristics.conv_estimate(config, posed, target)
        measured = conv_measured.measured_seconds(self.name, problem, target)
        if measured is None:
            return modeled
        best = conv_heuristics.rank(posed, target)[0].estimate_us * 1e-6
        return conv_measured.calibrated(modeled, best, measured)

    def _pointwise_space(self, problem: Problem):
        domain = problem.geometry.dims
        operands = [operand_strides(domain, o.dims, o.strides) for o in problem.outputs + problem.operands]
        if not domain or not operands:
            return None
        return iteration_space(domain, operands)

    def _attention_problem(self, problem: Problem) -> Optional[sdpa_heuristics.AttentionProblem]:
        g, q = problem.geometry, problem.operand("q")
        if problem.family != "sdpa" or g.direction != "forward" or q is None:
            return None
        bias = problem.operand("bias")
        return sdpa_heuristics.AttentionProblem(g.batch, g.heads, g.kv_heads, g.s_q, g.s_kv, g.head_dim,
                                                g.value_dim, q.data_type.itemsize, g.mask != "none",
                                                bias.data_type.itemsize if bias is not None else 0, g.causal)

    def _attention_estimate(self, problem: Problem, sched, target: Target) -> Optional[float]:
        """The forward model's seconds of `sched` (heuristics/sdpa.py forward_estimate), None
        where its shape class was never measured."""
        shape_class = forward_shape_class(problem)
        if shape_class is None or not isinstance(sched, sdpa_heuristics.AttentionSchedule):
            return None
        flops, moved = forward_work(problem)
        dot = "bf16" if problem.operand("q").data_type.name == "bfloat16" else "fp16"
        return sdpa_heuristics.forward_estimate(shape_class, flops, moved, sched, dot, target)

    def candidates(self, problem: Problem, target: Target, options=None) -> list:
        """The heuristics' ranked configs where the family has a model for the neutral problem,
        else one candidate: the builder's own choice (config None)."""
        family = problem.family
        ranked = None
        if family == "matmul":
            posed = self._matmul_problem(problem)
            ranked = posed and [Candidate(self.name, c, c.estimate_us * 1e-6)
                                for c in matmul_heuristics.rank(posed, target)]
        elif family == "conv":
            posed = self._conv_problem(problem)
            ranked = self._conv_candidates(problem, posed, target) if posed else self._gradient_candidates(problem, target)
        elif family in ("pointwise", "copy"):
            space = self._pointwise_space(problem)
            width = sum(o.data_type.itemsize for o in problem.outputs + problem.operands)
            ranked = space and [Candidate(self.name, c, c.estimate_us * 1e-6)
                                for c in pointwise_heuristics.rank(space, width, target)]
        elif family == "pooling":
            g = problem.geometry
            x = problem.operand("x") or problem.operands[0]
            cols = 1
            for size in g.output_spatial:
                cols *= size
            ranked = [Candidate(self.name, c, c.estimate_us * 1e-6)
                      for c in pooling_heuristics.rank(g.n * g.c, cols, x.data_type.itemsize, target)]
        elif family == "sdpa":
            posed = self._attention_problem(problem)
            if posed is not None:
                forced = sdpa_heuristics.NOT_FORCED if options is None else _forced_attention(options)
                sched = sdpa_heuristics.schedule(posed, target, forced=forced)
                ranked = [Candidate(self.name, sched, self._attention_estimate(problem, sched, target))]
        return ranked or [Candidate(self.name, None, None)]

    def estimate(self, problem: Problem, config, target: Target) -> Optional[float]:
        """Model seconds for `config` (a config of candidates()) on `problem`, None where none."""
        if config is None:
            return None
        if problem.family == "matmul" and (posed := self._matmul_problem(problem)) is not None:
            return matmul_heuristics.estimate(config, posed, target)
        if problem.family == "conv" and (posed := self._conv_problem(problem)) is not None:
            return self._conv_seconds(problem, posed, config, target)
        if problem.family in ("pointwise", "copy") and (space := self._pointwise_space(problem)) is not None:
            width = sum(o.data_type.itemsize for o in problem.outputs + problem.operands)
            return pointwise_heuristics.estimate(space, config.block_rows, config.block_cols, config.num_warps,
                                                 width, target)
        if problem.family == "sdpa":
            return self._attention_estimate(problem, config, target)
        return getattr(config, "estimate_us", None) and config.estimate_us * 1e-6

    def forces(self, problem: Problem, candidate: Candidate) -> bool:
        """Whether lower() runs `candidate`'s config as given (a plan choice builds exactly
        it): matmul configs; other families' lowering chooses its own config."""
        return problem.family == "matmul" and isinstance(candidate.config, matmul_heuristics.MatmulConfig)

    # -- lowering --------------------------------------------------------------------------------

    def lower(self, graph, group, problem: Problem, context, candidate: Optional[Candidate] = None) -> list:
        """Today's builder of the family, after the pointwise kernel that stores prologue values
        apart where the family needs it. A matmul `candidate` whose config is a MatmulConfig is
        run as given: forced through BuildOptions.matmul_config, the path a forced config takes
        (the reason says so), without autotuning; any other candidate (None, another family's,
        config None) leaves the choice to the builder."""
        if candidate is not None and group.kind == "matmul" and \
                isinstance(candidate.config, matmul_heuristics.MatmulConfig):
            context = replace(context, options=replace(context.options, matmul_config=candidate.config), tuner=None)
        launches = []
        stored = prologue_values_to_store(group) if group.kind in self.prologue_stored_apart else None
        if stored is not None:
            launches.append(build_pointwise(graph, stored, context))
        built = self.builders[group.kind](graph, group, context)
        launches.extend(built if isinstance(built, list) else [built])
        return launches


# The options that force this backend's config or schedule, by the families other backends lower
# too (gluon: matmul, conv, sdpa; tests/backends/test_backend_choice.py holds every other
# backend's families to this table). Unset is None, or False for sdpa_index_64 (0 is set:
# sdpa_head_group=0 forces the plain grid). A conv may run
# as a matmul (1x1) or a depthwise kernel, so it reads all three of its configs.
FORCED_OPTIONS = {
    "matmul": ("matmul_config",),
    "conv": ("conv_config", "matmul_config", "depthwise_config"),
    "sdpa": ("sdpa_config", "sdpa_dkdv_config", "sdpa_dq_config", "sdpa_splits", "sdpa_head_group",
             "sdpa_index_64"),
}


def _forced_attention(options) -> "sdpa_heuristics.ForcedAttention":
    o = options
    return sdpa_heuristics.ForcedAttention(o.sdpa_config, o.sdpa_dkdv_config, o.sdpa_dq_config, o.sdpa_splits,
                                           o.sdpa_head_group)


TRITON = TritonBackend()
