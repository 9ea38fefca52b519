"""Recurrent layers, bf16, against torch's nn.LSTM / nn.GRU (cuDNN) in one process (GPU only).

Cases (the issue's goals):
  train   LSTM and GRU training step: 4 layers, hidden 1024, batch 64, 50 steps (NMT-like);
          forward + backward (data and weight gradients) through g.rnn's as_function
  infer   LSTM and GRU inference, 4 layers, hidden 1024, 50 steps, batch 1, 2, 4, 8 (latency)

Every dnngraph result is checked against cuDNN (relative norm error) before it is timed; a case
that fails prints "n/a: <error>". Ratios are cuDNN time / dnngraph time (> 1: dnngraph faster).
explain() of each graph says which recurrence kernels ran (the last column: persistent with the
weights resident or streamed, or a launch per step).

    python benchmarks/bench_rnn.py                 # every case
    python benchmarks/bench_rnn.py --cases train   # the training steps only
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median_ms, print_table, rel_error, write_json  # noqa: E402

import dnngraph as dg  # noqa: E402

LAYERS, HIDDEN, STEPS = 4, 1024, 50
MODULES = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}


def _graph(mode: str, module, x, h0, c0):
    """g.rnn with the module's weights; returns (graph, inputs, outputs)."""
    g = dg.Graph(name=f"bench_{mode}", io_data_type=dg.bfloat16)
    xt, ht = g.tensor_like(x, name="x"), g.tensor_like(h0, name="h0")
    ct = g.tensor_like(c0, name="c0") if mode == "lstm" else None
    weights = [g.tensor_like(w.detach(), name=f"w{i}") for i, w in enumerate(module._flat_weights)]
    y, h_n, c_n = g.rnn(xt, ht, ct, weights, mode=mode, num_layers=LAYERS)
    outputs = [t.set_output(True) for t in (y, h_n, c_n) if t is not None]
    inputs = [xt, ht] + ([ct] if ct is not None else []) + weights
    return g, inputs, outputs


def _case(mode: str, batch: int, train: bool) -> list:
    torch.manual_seed(0)
    module = MODULES[mode](HIDDEN, HIDDEN, num_layers=LAYERS).cuda().bfloat16()
    x = torch.randn(STEPS, batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
    h0 = torch.randn(LAYERS, batch, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.1
    c0 = torch.randn_like(h0)
    state = (h0, c0) if mode == "lstm" else h0
    g, inputs, outputs = _graph(mode, module, x, h0, c0)
    fn = g.as_function(inputs=inputs, outputs=outputs)
    values = [x, h0] + ([c0] if mode == "lstm" else []) + [w.detach() for w in module._flat_weights]
    label = f"{mode} {'train' if train else 'infer'} B={batch}"
    if train:
        leaves = [v.clone().requires_grad_(True) for v in values]
        seed = torch.randn(STEPS, batch, HIDDEN, device="cuda", dtype=torch.bfloat16)

        def ours():
            y = fn(*leaves)[0]
            return torch.autograd.grad(y, leaves, seed)

        def cudnn():
            x_leaf = x.detach().requires_grad_(True)
            y, _ = module(x_leaf, state)
            return torch.autograd.grad(y, [x_leaf] + list(module.parameters()), seed)
        check = (ours()[0], cudnn()[0])
    else:
        def ours():
            return fn(*values)

        def cudnn():
            with torch.no_grad():
                return module(x, state)
        check = (ours()[0], cudnn()[0])
    try:
        error = rel_error(*check)
        ours_ms = median_ms(ours, warmup=3, rep=20)
    except Exception as failure:  # a failing provider prints its error in its cell
        return [label, f"n/a: {type(failure).__name__}: {failure}"[:120], "", "", "", ""]
    cudnn_ms = median_ms(cudnn, warmup=3, rep=20)
    g.build()  # the graph itself (as_function ran its replayed copies): what explain() reports
    why = "\n".join(line for line in g.explain().splitlines() if "why:" in line)
    kind = "per-step" if "launches per step" in why else ("resident" if "kept in registers" in why else "streamed")
    return [label, f"{ours_ms:.3f}", f"{cudnn_ms:.3f}", f"{cudnn_ms / ours_ms:.3f}x", f"{error:.2e}", kind]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", choices=["all", "train", "infer"], default="all")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_rnn: needs a CUDA device")
        return
    rows = []
    for mode in MODULES:
        if args.cases in ("all", "train"):
            rows.append(_case(mode, 64, True))
        if args.cases in ("all", "infer"):
            rows += [_case(mode, batch, False) for batch in (1, 2, 4, 8)]
    print_table(f"RNN, bf16, {LAYERS} layers, hidden {HIDDEN}, {STEPS} steps ({torch.cuda.get_device_name()})",
                ["case", "dnngraph ms", "cuDNN ms", "ratio", "rel err", "recurrence"], rows)
    write_json("rnn.json", {"rows": rows})


if __name__ == "__main__":
    main()
