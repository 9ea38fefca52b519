"""The flash backward of attention written as ops (an attention_backward group).

Three kernels, the sdpa backward's (codegen/sdpa.py) with the score modifier rendered inside:
  * the log-sum-exp pass: the forward kernel without P V, storing each row's log-sum-exp;
  * dK/dV per key block and dQ per query block. Each block recomputes s = q k^T, runs the score
    ops on it through the emitter (their side tensors loaded at (batch, head, query, key)),
    takes p = exp2(s' log2(e) - lse), dS' = p (dP - delta), and runs the score ops' gradient ops
    (the nodes the backward rules wrote) on dS' to get the dS that dQ and dK multiply.
Values made inside the group never reach memory. Masked blocks (past the sequence ends) get
p = 0 and dS = 0.
"""
from __future__ import annotations

from .emitter import element_load, kind_of
from ...contract import KernelSource
from .pointwise import kernel_module
from .sdpa import LOG2E, AttentionSpec, BackwardWriter, ScoreModifier, attention_arguments, render

__all__ = ["render_lse", "render_chain_backward", "ScoreModifier"]


class _ChainWriter(BackwardWriter):
    def __init__(self, spec: AttentionSpec, compute_type: str, roles):
        made = (roles.softmax.outputs[0].uid, roles.multiply.outputs[0].uid) if roles.multiply is not None \
            else (roles.softmax.outputs[0].uid,)
        modifier = ScoreModifier(roles.scores.outputs[0].uid, roles.score_ops + roles.grad_ops, made)
        super().__init__(spec, compute_type, modifier)
        self.roles = roles

    def head_offsets(self, head: str, depth: int):
        super().head_offsets(head, depth)
        wide = ".to(tl.int64)" if self.spec.wide_index else ""
        for stem in self.sides:
            self.line(f"{stem}_base = batch{wide} * {stem}_s0 + {head}{wide} * {stem}_s1", depth)

    def flush(self, depth: int):
        for text in self.emitter.lines:
            self.line(text, depth)
        self.emitter.lines.clear()

    def logits(self, product: str, rows: str, keys: str, r: str, c: str, transposed: bool, masked: bool,
               depth: int) -> str:
        w, e, roles = self.line, self.emitter, self.roles
        wide = ".to(tl.int64)" if self.spec.wide_index else ""
        w(f"scores = {product}", depth)
        e.bind(roles.scores.outputs[0].uid, "scores", "f")
        for stem, tensor in self.sides.items():
            variable = self.names.fresh("sval")
            load = element_load(f"{stem}_ptr", f"{stem}_base + {r}{wide} * {stem}_s2 + {c}{wide} * {stem}_s3",
                                f"({r} < len_q) & ({c} < len_kv)", tensor.data_type)
            w(f"{variable} = {e.loaded(load, tensor.data_type)}", depth)
            e.bind(tensor.uid, variable, kind_of(tensor.data_type))
        for node in roles.score_ops:
            e.emit(node)
        self.flush(depth)
        w(f"logits = {e.value(roles.softmax.inputs[0].uid, 'f')} * {LOG2E!r}", depth)
        if masked:
            w(f"visible = ({c} < len_kv) & ({r} < len_q)", depth)
            w("logits = tl.where(visible, logits, float('-inf'))", depth)
        return "logits"

    def score_grad(self, which: str, masked: bool, depth: int) -> str:
        """dS of the scores: the gradient ops run on dS' (the value the dQ or dK product reads)."""
        e, roles = self.emitter, self.roles
        target = roles.dq.inputs[0] if which == "dq" else roles.dk_scores
        e.bind(roles.softmax.outputs[0].uid, "p_tile", "f")
        e.bind(roles.multiply.outputs[0].uid, "d_scores", "f")
        for node in roles.grad_ops:
            e.emit(node)
        self.flush(depth)
        value = e.value(target.uid, "f")
        if not masked:
            return value
        self.line(f"d_grad = tl.where(visible, {value}, 0.0)", depth)
        return "d_grad"


def _source(kernel_name: str, description: str, writer, args) -> str:
    return kernel_module(description, writer.emitter.globals, kernel_name, args, "\n".join(writer.body) + "\n",
                         libraries=("lib",), helpers=writer.helper_texts(args))


def render_chain_backward(kernel_name: str, which: str, spec: AttentionSpec, roles, compute_type: str,
                          description: str):
    """The KernelSource (name, source, arguments) of the "dkdv" or "dq" kernel of an attention_backward group with
    the roles `roles` (fusion/attention.py) under `spec`."""
    writer = _ChainWriter(spec, compute_type, roles)
    (writer.dkdv_kernel if which == "dkdv" else writer.dq_kernel)()
    args = attention_arguments(spec, dict(writer.sides), writer.emitter.scalars)
    return KernelSource(kernel_name, _source(kernel_name, description, writer, args), args)


def render_lse(kernel_name: str, spec: AttentionSpec, group, roles, compute_type: str, description: str):
    """The KernelSource (name, source, arguments) of the log-sum-exp pass: the forward kernel of the chain's score ops
    without P V (spec.stats_only)."""
    modifier = ScoreModifier(roles.scores.outputs[0].uid, roles.score_ops)
    return render(kernel_name, spec, group, None, [], compute_type, description, modifier)
