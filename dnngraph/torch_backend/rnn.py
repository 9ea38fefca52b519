"""torch's recurrent layers (nn.RNN, nn.LSTM, nn.GRU) as one op each in the traced aten graphs.

AOTAutograd traces `aten.lstm.input` (and gru, rnn_tanh, rnn_relu) through torch's Python
decompositions (torch/_decomp: the per-step math on the GPU, mkldnn_rnn_layer on the CPU), so
the backend would never see a layer whole. While this backend traces (`traced_rnns()`), those
ops instead call `dnngraph::rnn`, a custom op whose converter (convert.py) builds `g.rnn`: one
GEMM per layer and direction for the input projection and one persistent recurrence kernel.
Its gradient is `dnngraph::rnn_backward` (data, state and weight gradients), which runs in torch
(its eager implementation differentiates torch's own layer) until a converter takes it.

Dropout between layers in training is left to torch's decomposition (the counters of torch's
generator are not dnngraph's), and so are packed sequences (`aten.lstm.data`).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Optional

import torch
from torch._C import DispatchKey

aten = torch.ops.aten
MODES = {aten.lstm.input: "lstm", aten.gru.input: "gru", aten.rnn_tanh.input: "rnn_tanh",
         aten.rnn_relu.input: "rnn_relu"}
_TORCH_LAYERS = {"lstm": torch._VF.lstm, "gru": torch._VF.gru, "rnn_tanh": torch._VF.rnn_tanh,
                 "rnn_relu": torch._VF.rnn_relu}
_LOCK = threading.Lock()
_ISOLATED = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dnngraph-rnn-backward")


def _states(mode: str, hx: list):
    """torch's hx argument of `mode`: a pair (h, c) for lstm, one tensor otherwise."""
    return (hx[0], hx[1]) if mode == "lstm" else hx[0]


def _torch_layer(x, hx, params, mode, has_biases, num_layers, bidirectional, batch_first, train=False) -> list:
    """[y, h_n(, c_n)] of torch's own layer (no dropout: the op is only made without it). `train`
    for a layer to be differentiated: cuDNN's backward refuses a forward run in eval mode."""
    return list(_TORCH_LAYERS[mode](x, _states(mode, hx), params, has_biases, num_layers, 0.0, train,
                                    bidirectional, batch_first))


@torch.library.custom_op("dnngraph::rnn", mutates_args=())
def rnn(x: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor], mode: str, has_biases: bool,
        num_layers: int, bidirectional: bool, batch_first: bool) -> list[torch.Tensor]:
    """[y, h_n(, c_n)] of a torch recurrent layer, as one op."""
    return [t.clone() for t in _torch_layer(x, hx, params, mode, has_biases, num_layers, bidirectional, batch_first)]


@rnn.register_fake
def _rnn_fake(x, hx, params, mode, has_biases, num_layers, bidirectional, batch_first):
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    width = hx[0].shape[-1] * (2 if bidirectional else 1)
    y = x.new_empty((batch, steps, width) if batch_first else (steps, batch, width))
    return [y] + [h.new_empty(h.shape) for h in hx]


@torch.library.custom_op("dnngraph::rnn_backward", mutates_args=())
def rnn_backward(x: torch.Tensor, hx: list[torch.Tensor], params: list[torch.Tensor], grads: list[torch.Tensor],
                 mode: str, has_biases: bool, num_layers: int, bidirectional: bool,
                 batch_first: bool) -> list[torch.Tensor]:
    """[dx] + dhx + dparams of dnngraph::rnn given the gradients of its outputs."""
    # a custom op runs below autograd (its dispatch keys excluded in this thread's state), so
    # torch's layer is differentiated on a thread of its own, on the caller's stream
    stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
    return _ISOLATED.submit(_torch_gradients, stream, x, hx, params, grads, mode, has_biases, num_layers,
                            bidirectional, batch_first).result()


def _torch_gradients(stream, x, hx, params, grads, mode, has_biases, num_layers, bidirectional, batch_first):
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in [x] + list(hx) + list(params)]
        outputs = _torch_layer(leaves[0], leaves[1:1 + len(hx)], leaves[1 + len(hx):], mode, has_biases, num_layers,
                               bidirectional, batch_first, train=True)
        found = torch.autograd.grad(outputs, leaves, list(grads), allow_unused=True)
    # cuDNN's weight gradients are views of one flat buffer, and a custom op's results may alias
    # neither each other nor its inputs: each is returned in storage of its own
    return [torch.zeros_like(leaf) if grad is None else grad.clone() for leaf, grad in zip(leaves, found)]


@rnn_backward.register_fake
def _rnn_backward_fake(x, hx, params, grads, mode, has_biases, num_layers, bidirectional, batch_first):
    return [t.new_empty(t.shape) for t in [x] + list(hx) + list(params)]


def _setup_context(ctx, inputs, output):
    x, hx, params, *flags = inputs
    ctx.save_for_backward(x, *hx, *params)
    ctx.counts = (len(hx), len(params))
    ctx.flags = flags


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    hx_count, _ = ctx.counts
    x, hx, params = saved[0], list(saved[1:1 + hx_count]), list(saved[1 + hx_count:])
    found = rnn_backward(x, hx, params, list(grads), *ctx.flags)
    return found[0], found[1:1 + hx_count], found[1 + hx_count:], None, None, None, None, None


rnn.register_autograd(_backward, setup_context=_setup_context)


def _substitute(op, original):
    """The implementation of `op` while tracing: dnngraph::rnn where it can stand for the layer."""
    mode = MODES[op]

    def traced(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        if dropout and train:
            return original(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
        states = list(hx) if mode == "lstm" else [hx]
        out = rnn(x, states, list(params), mode, bool(has_biases), int(num_layers), bool(bidirectional),
                  bool(batch_first))
        return (out[0], out[1], out[2]) if mode == "lstm" else (out[0], out[1])
    return traced


@contextlib.contextmanager
def traced_rnns():
    """While AOTAutograd traces: torch's recurrent layers become dnngraph::rnn (the Python
    decompositions of aten.lstm/gru/rnn_tanh/rnn_relu.input swapped, and put back after)."""
    with _LOCK:
        saved = {}
        try:
            for op in MODES:
                for key in (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd):
                    original: Optional[object] = op.py_kernels.get(key)
                    if original is None:
                        continue
                    saved[(op, key)] = original
                    op.py_kernels[key] = _substitute(op, original)
            _clear_caches()
            yield
        finally:
            for (op, key), original in saved.items():
                op.py_kernels[key] = original
            _clear_caches()


def _clear_caches():
    for op in MODES:
        op._dispatch_cache.clear()
