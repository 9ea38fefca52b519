"""CUDA-graph replay of the backend's compiled graphs (`mode="reduce-overhead"`).

Each AOTAutograd forward and backward graph, once compiled (dnngraph partitions and the ops left
to torch), is handed to torch's cudagraph trees, as torch's own "cudagraphs" backend does with
an uncompiled graph: the first calls run as they are (warm-up: plans build, kernels compile),
later ones record one CUDA graph per graph and replay it, so a step costs one launch per graph
instead of one per kernel. The trees own the memory of the recorded outputs and the copies of
the inputs that are not parameters; a graph they cannot record (an input mutated inside it, a
CPU tensor, more than one device) runs without replay, and the reason is logged, as torch does.

Dropout stays random under replay: its seeds come from torch's CUDA generator, which advances
its offset on every replay of a recorded graph.
"""
from __future__ import annotations

from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.cudagraphs import (check_for_skip, find_input_mutations, get_device_index,
                                               get_device_node_mapping, get_stack_traces)
from torch._inductor.compile_fx import get_static_input_idxs
from torch._inductor.cudagraph_utils import BoxedDeviceIndex, get_placeholder_info, log_cudagraph_skip_and_bump_counter
from torch._inductor.utils import BoxedBool, count_tangents, num_fw_fixed_arguments

from ..log import logger


def _recorded(compiled, aot_model, aot_inputs, static: list, device_index: int, is_backward: bool,
              is_inference: bool):
    """`compiled` (a boxed callable of `aot_model`) recorded and replayed by the cudagraph trees;
    the `static` inputs (parameters and buffers; a backward's saved values) are read where they
    are (a new address records again), the others are copied into the trees' memory per call."""
    from torch._inductor.cudagraph_trees import cudagraphify_impl

    replayed = cudagraphify_impl(_stealing(compiled), aot_inputs, static, device_index=device_index,
                                 is_backward=is_backward, is_inference=is_inference,
                                 stack_traces=get_stack_traces(aot_model),
                                 placeholders=get_placeholder_info(aot_model.graph),
                                 mutated_input_idxs=find_input_mutations(aot_model.graph))
    replayed._boxed_call = True
    return replayed


def _stealing(compiled):
    """`compiled` called as the trees call a model: it takes the input list over and empties it
    (the trees require it)."""
    def run(inputs: list):
        taken = list(inputs)
        inputs.clear()
        return compiled(taken)

    run._boxed_call = True
    return run


def _why_not(aot_model, fixed: int):
    """Why `aot_model` cannot be recorded, or None. The devices are checked here: torch's check
    lets CPU ops through when inductor's own graph partitioning is on (inductor splits them out
    of its graphs; these graphs are not split), and a CPU op would then run only while recording."""
    devices = get_device_node_mapping(aot_model)
    if any(device.type != "cuda" for device in devices):
        return "skipping cudagraphs due to a tensor off CUDA ({})".format(
            ", ".join(sorted(f"{node.name} on {device}" for device, node in devices.items() if device.type != "cuda")))
    if len(devices) > 1:
        return f"skipping cudagraphs due to several devices ({', '.join(sorted(str(d) for d in devices))})"
    if not devices:
        return "skipping cudagraphs due to no CUDA tensor"
    return check_for_skip(aot_model, fixed)


def _skipped(reason: str) -> None:
    log_cudagraph_skip_and_bump_counter(reason)
    logger.info("torch.compile backend: no CUDA-graph replay (%s)", reason)


def aot_with_cudagraphs(compile_graph, dynamo_model, dynamo_inputs):
    """AOTAutograd over `dynamo_model` whose forward and backward graphs are compiled by
    `compile_graph(aot_model, aot_inputs)` (a boxed callable) and replayed as CUDA graphs."""
    replay_forward, device = BoxedBool(True), BoxedDeviceIndex(None)

    def forward(aot_model, aot_inputs, is_inference: bool = False):
        compiled = compile_graph(aot_model, aot_inputs)
        fixed = num_fw_fixed_arguments(len(dynamo_inputs), len(aot_inputs))
        reason = _why_not(aot_model, fixed)
        if reason:
            BoxedBool.disable(replay_forward)
            _skipped(reason)
            return compiled
        device.set(get_device_index(aot_model))
        # every parameter is static, also those dynamo passes as inputs (inlined modules'):
        # copying a Llama layer's weights per call cost 0.3 ms
        static = get_static_input_idxs(fixed)
        return _recorded(compiled, aot_model, aot_inputs, static, device.value, False, is_inference)

    def backward(aot_model, aot_inputs):
        compiled = compile_graph(aot_model, aot_inputs)
        if not replay_forward:
            return compiled
        fixed = count_tangents(aot_model)
        reason = _why_not(aot_model, fixed)
        if reason:
            _skipped(reason)
            return _running_backward(compiled, device.value or 0)
        return _recorded(compiled, aot_model, aot_inputs, list(range(fixed)), get_device_index(aot_model), True, False)

    return aot_autograd(fw_compiler=forward, bw_compiler=backward,
                        inference_compiler=lambda model, inputs: forward(model, inputs, is_inference=True))(
        dynamo_model, dynamo_inputs)


def _running_backward(compiled, device_index: int):
    """A backward that runs without replay after a replayed forward: the trees are told, so the
    forward's recorded outputs it reads stay valid (what torch's backend does)."""
    import torch._inductor.cudagraph_trees as trees

    def run(inputs):
        manager = trees.get_manager(device_index, create_if_none_exists=False)
        if manager is not None:
            manager.set_to_running_backward()
        return compiled(inputs)

    run._boxed_call = True
    return run
