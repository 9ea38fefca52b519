"""Render a CTC group: the loss kernel (one program per batch entry), the reduction kernel of a
"sum" or "mean" loss, and the gradient's two kernels (the recursions, one program per entry;
then every frame's classes, one program per frame and entry). The recursion is fixed structure and lives in the
device library (`ctc_library`, imported as `ctc`); the generated text is each kernel's signature
and the call that hands it its pointers, strides and sizes."""
from __future__ import annotations

from ...contract import KernelSource
from ..codegen.ctc_library import MEAN, NONE, SUM
from .pointwise import KernelArgument, kernel_module

INDENT = "    "
REDUCTION_CODES = {"none": NONE.value, "sum": SUM.value, "mean": MEAN.value}


def _tensor(name: str, tensor, rank_strides: int) -> list:
    """The pointer and `rank_strides` strides of `tensor` (absent axes give stride 0)."""
    strides = tuple(tensor.stride) + (0,) * (rank_strides - len(tensor.stride))
    return [KernelArgument("tensor", f"{name}_ptr", tensor.uid)] + \
        [KernelArgument("int", f"{name}_stride_{axis}", int(stride)) for axis, stride in enumerate(strides)]


def _inputs(node) -> list:
    log_probs, targets, input_lengths, target_lengths = node.inputs[:4]
    return (_tensor("lp", log_probs, 3) + _tensor("targets", targets, 2) + _tensor("input_lengths", input_lengths, 1)
            + _tensor("target_lengths", target_lengths, 1))


def _sizes(geometry, config) -> list:
    return [KernelArgument("int", "N", geometry.batch), KernelArgument("int", "T", geometry.steps),
            KernelArgument("int", "C", geometry.classes), KernelArgument("int", "WIDTH", geometry.label_width),
            KernelArgument("int", "BLANK", geometry.blank),
            KernelArgument("int", "STATES", 2 * geometry.label_width + 1),
            KernelArgument("constexpr", "ZERO_INFINITY", geometry.zero_infinity),
            KernelArgument("constexpr", "REDUCTION", REDUCTION_CODES[geometry.reduction]),
            KernelArgument("constexpr", "CONCATENATED", geometry.concatenated),
            KernelArgument("constexpr", "BLOCK_L", config.block_l),
            KernelArgument("constexpr", "BLOCK_N", config.block_n),
            KernelArgument("constexpr", "BLOCK_C", config.block_c),
            KernelArgument("constexpr", "BLOCK_T", config.block_t)]


INPUT_CALL = ("lp_ptr, lp_stride_0, lp_stride_1, lp_stride_2, targets_ptr, targets_stride_0, targets_stride_1, "
              "input_lengths_ptr, input_lengths_stride_0, target_lengths_ptr, target_lengths_stride_0")


def _alpha(tensor) -> tuple:
    """(arguments, call text) of a log_alpha tensor [N, T, STATES]: its pointer and strides, or
    where there is none, log_probs' pointer and zero strides, never read or written."""
    if tensor is None:
        return [], "lp_ptr, 0, 0, 0"
    return _tensor("alpha", tensor, 3), "alpha_ptr, alpha_stride_0, alpha_stride_1, alpha_stride_2"


def _source(kernel_name: str, description: str, args: list, call: str) -> KernelSource:
    return KernelSource(kernel_name, kernel_module(description, [], kernel_name, args, INDENT + call + "\n",
                                                   libraries=("ctc",)), args)


def render_loss(kernel_name: str, group, geometry, config, losses_uid: int, losses_stride: int, log_alpha,
                description: str) -> KernelSource:
    """Each entry's loss into tensor `losses_uid` (the [N] loss output, or a scratch of N
    float32 a reduction kernel folds), entries `losses_stride` apart; its log_alpha rows into
    `log_alpha` (the op's second output) unless None."""
    alpha_args, alpha_call = _alpha(log_alpha)
    args = (_inputs(group.anchor) + [KernelArgument("tensor", "loss_ptr", losses_uid),
                                     KernelArgument("int", "loss_stride_0", losses_stride)] + alpha_args
            + _sizes(geometry, config) + [KernelArgument("constexpr", "STORE_ALPHA", log_alpha is not None)])
    call = (f"ctc.loss_entry({INPUT_CALL}, loss_ptr, loss_stride_0, {alpha_call}, STATES, T, C, WIDTH, BLANK, "
            f"ZERO_INFINITY, REDUCTION, CONCATENATED, STORE_ALPHA, BLOCK_L, BLOCK_N)")
    return _source(kernel_name, description, args, call)


def render_reduce(kernel_name: str, geometry, config, losses_uid: int, out, description: str) -> KernelSource:
    """The one-program kernel folding the scratch's N losses into the [1] output."""
    args = [KernelArgument("tensor", "losses_ptr", losses_uid), KernelArgument("tensor", "out_ptr", out.uid),
            KernelArgument("int", "N", geometry.batch),
            KernelArgument("constexpr", "REDUCTION", REDUCTION_CODES[geometry.reduction]),
            KernelArgument("constexpr", "BLOCK_N", config.block_n)]
    return _source(kernel_name, description, args, "ctc.reduce_losses(losses_ptr, N, out_ptr, REDUCTION, BLOCK_N)")


def render_occupancy(kernel_name: str, group, geometry, config, rows_uid: int, nll_uid: int, log_alpha,
                     description: str) -> KernelSource:
    """The recursions of each entry: per-state occupancy rows into scratch `rows_uid`, each
    entry's nll into scratch `nll_uid`; log_alpha read from `log_alpha` (the forward's) unless
    None (then recomputed)."""
    alpha_args, alpha_call = _alpha(log_alpha)
    args = (_inputs(group.anchor) + [KernelArgument("tensor", "rows_ptr", rows_uid),
                                     KernelArgument("tensor", "nll_ptr", nll_uid)] + alpha_args
            + _sizes(geometry, config) + [KernelArgument("constexpr", "ALPHA_GIVEN", log_alpha is not None)])
    call = (f"ctc.occupancy_entry({INPUT_CALL}, rows_ptr, nll_ptr, {alpha_call}, STATES, T, C, WIDTH, BLANK, "
            f"CONCATENATED, ALPHA_GIVEN, BLOCK_L, BLOCK_N)")
    return _source(kernel_name, description, args, call)


def render_gradient(kernel_name: str, group, geometry, config, rows_uid: int, nll_uid: int,
                    description: str) -> KernelSource:
    """d log_probs, one program per (BLOCK_T frames, entry), from the occupancy kernel's scratch."""
    node = group.anchor
    grad_loss, grad = node.inputs[4], node.outputs[0]
    args = (_inputs(node) + _tensor("grad_loss", grad_loss, 1)[:2] + _tensor("grad", grad, 3)
            + [KernelArgument("tensor", "rows_ptr", rows_uid), KernelArgument("tensor", "nll_ptr", nll_uid)]
            + _sizes(geometry, config))
    call = (f"ctc.frame_gradient({INPUT_CALL}, grad_loss_ptr, grad_loss_stride_0, grad_ptr, grad_stride_0, "
            f"grad_stride_1, grad_stride_2, rows_ptr, nll_ptr, N, T, C, WIDTH, BLANK, ZERO_INFINITY, REDUCTION, "
            f"CONCATENATED, BLOCK_L, BLOCK_N, BLOCK_C, BLOCK_T)")
    return _source(kernel_name, description, args, call)
