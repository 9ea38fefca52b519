"""Render a recurrence group: a kernel whose body calls the fixed recurrence of rnn_library
(`rl`) with the group's tensors, their strides and the schedule's numbers as literals.

Parameter names are fixed roles (xw, w_hh, y, ...): no user name reaches the source but the
sanitized docstring. An optional tensor the node lacks is passed as a stand-in (xw, strides 0)
that the library never touches (its HAS_* flag is False).
"""
from __future__ import annotations

from ...contract import KernelSource
from .pointwise import KernelArgument, kernel_module

MODE_NUMBERS = {"rnn_tanh": 0, "rnn_relu": 1, "lstm": 2, "gru": 3}

FORWARD_TENSORS = (("xw", 3), ("h0", 2), ("c0", 2), ("w_hh", 2), ("b_hh", 1), ("w_hr", 2), ("lengths", 1),
                   ("y", 3), ("h_n", 2), ("c_n", 2), ("h_prev", 3), ("c_prev", 3), ("h_raw", 3))
BACKWARD_TENSORS = (("xw", 3), ("w_hh", 2), ("b_hh", 1), ("w_hr", 2), ("lengths", 1), ("h_prev", 3),
                    ("c_prev", 3), ("dy", 3), ("dh_n", 2), ("dc_n", 2), ("dxw", 3), ("dhh", 3), ("dh0", 2),
                    ("dc0", 2), ("d_proj", 3))


def _tensor_arguments(roles, tensors, stand_in) -> tuple[list, list]:
    """(KernelArguments, call expressions): per role the pointer and one stride per axis."""
    args, call = [], []
    for (role, rank), tensor in zip(roles, tensors):
        present = tensor is not None
        args.append(KernelArgument("tensor", role, (tensor if present else stand_in).uid))
        call.append(role)
        for axis in range(rank):
            stride = int(tensor.stride[axis]) if present else 0
            args.append(KernelArgument("int", f"{role}_s{axis}", stride))
            call.append(f"{role}_s{axis}")
    return args, call


def render(kernel_name: str, schedule, node, geometry, dot, description: str) -> KernelSource:
    """The KernelSource of one recurrence node under `schedule` (lower/rnn.py's RnnSchedule)."""
    forward = node.op == "rnn_recurrence"
    roles = FORWARD_TENSORS if forward else BACKWARD_TENSORS
    tensors = list(node.inputs) + list(node.outputs)
    args, call = _tensor_arguments(roles, tensors, node.inputs[0])
    args += [KernelArgument("int", "T", geometry.steps), KernelArgument("int", "B", geometry.batch)]
    call += ["T", "B"]
    # the steps a launch runs (and, backward, its phases): lower/rnn.py sets them per launch in step mode
    if forward:
        args += [KernelArgument("int", "k_first", 0), KernelArgument("int", "k_count", geometry.steps)]
        call += ["k_first", "k_count"]
    else:
        args += [KernelArgument("int", "k_first", 0), KernelArgument("int", "k_count", geometry.steps),
                 KernelArgument("int", "phases", 3)]
        call += ["k_first", "k_count", "phases"]
    flags = {"MODE": MODE_NUMBERS[geometry.mode], "REVERSE": geometry.reverse, "G": geometry.gates,
             "H": geometry.hidden, "P": geometry.state, "HAS_BIAS": node.inputs[roles.index(("b_hh", 1))] is not None,
             "HAS_PROJ": node.inputs[roles.index(("w_hr", 2))] is not None,
             "HAS_LENGTHS": node.inputs[roles.index(("lengths", 1))] is not None}
    if forward:
        flags.update(RESIDENT=schedule.resident)
    else:
        flags.update(HAS_DY=node.inputs[7] is not None, HAS_DH=node.inputs[8] is not None,
                     HAS_DC=node.inputs[9] is not None)
    flags["STEP_MODE"] = schedule.step_launches
    flags.update(BLOCK_B=schedule.block_b, BLOCK_H=schedule.block_h, BLOCK_K=schedule.block_k,
                 FP32_DOT=dot.dot in ("fp32", "tf32"), PRECISION=repr(dot.precision or "ieee"))
    call += [f"{name}={value}" for name, value in flags.items()]
    function = "rl.rnn_forward" if forward else "rl.rnn_backward"
    body = f"    {function}(\n" + "".join(f"        {item},\n" for item in call) + "    )\n"
    return KernelSource(kernel_name, kernel_module(description, [], kernel_name, args, body, libraries=("rl",)),
                        tuple(args))
