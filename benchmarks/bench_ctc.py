"""CTC loss, forward and forward+backward, against torch's F.ctc_loss on the GPU (GPU only).

One process, side by side per case (T frames, N batch entries, C classes, S target labels;
input lengths drawn in [0.8 T, T], target lengths in [0.6 S, S], "mean" reduction, float32
log_probs from a log_softmax). Providers:

  torch native  F.ctc_loss with int64 CUDA targets and lengths (torch's own CUDA kernels)
  torch cuDNN   F.ctc_loss with int32 CPU targets, concatenated, every input length T: the form
                for which torch calls cuDNN's CTC (where torch._use_cudnn_ctc_loss says it does;
                else "n/a")
  dnngraph      g.ctc_loss through as_function (its backward: ctc_loss_backward)

Timings are medians of triton.testing.do_bench; "fwd" is the loss alone, "fwd+bwd" the loss and
loss.backward() into log_probs.grad. Ratios are torch native time / dnngraph time (> 1: dnngraph
faster). The loss and the gradient are checked against torch native before timing.

    python benchmarks/bench_ctc.py                 # GPU: every case; $OUT/ctc.json
    python benchmarks/bench_ctc.py --cases speech  # T=500, N=32, C=29, S=100 (the issue's goal)
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

# (T, N, C, S)
CASES = {
    "speech": (500, 32, 29, 100),
    "long": (1000, 16, 29, 200),
    "wide_vocab": (200, 32, 1000, 50),
}


def case_tensors(case: tuple, seed: int = 0) -> dict:
    steps, batch, classes, width = case
    gen = torch.Generator().manual_seed(seed)
    log_probs = torch.randn(steps, batch, classes, generator=gen).log_softmax(-1).cuda()
    targets = torch.randint(1, classes, (batch, width), generator=gen)
    input_lengths = torch.randint(int(0.8 * steps), steps + 1, (batch,), generator=gen)
    target_lengths = torch.randint(int(0.6 * width), width + 1, (batch,), generator=gen)
    return {"log_probs": log_probs, "targets": targets.cuda(), "input_lengths": input_lengths.cuda(),
            "target_lengths": target_lengths.cuda(), "cpu_targets": targets, "cpu_target_lengths": target_lengths}


def dnngraph_function(values: dict):
    import dnngraph as dg
    g = dg.Graph(name="ctc", io_data_type=dg.float32, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    names = ("log_probs", "targets", "input_lengths", "target_lengths")
    tensors = [g.tensor_like(values[name], name=name) for name in names]
    g.ctc_loss(*tensors, reduction="mean").set_output(True).set_name("loss")
    g.build()
    fn = g.as_function()
    return lambda log_probs: fn(log_probs, values["targets"], values["input_lengths"], values["target_lengths"])


def torch_native(values: dict):
    return lambda log_probs: F.ctc_loss(log_probs, values["targets"], values["input_lengths"],
                                        values["target_lengths"], reduction="mean")


def torch_cudnn(values: dict):
    """cuDNN's form: concatenated int32 CPU targets, every input length T; None where torch
    would not call cuDNN for it."""
    log_probs = values["log_probs"]
    steps, batch = log_probs.shape[:2]
    lengths = values["cpu_target_lengths"].to(torch.int32)
    concatenated = torch.cat([values["cpu_targets"][k, :int(n)] for k, n in enumerate(lengths)]).to(torch.int32)
    input_lengths = torch.full((batch,), steps, dtype=torch.int32)
    if not torch._use_cudnn_ctc_loss(log_probs, concatenated, input_lengths.tolist(), lengths.tolist(), 0):
        return None
    # lengths as Python lists: the mean's division then runs on the loss's device (CPU length
    # tensors fail there, "expected all tensors on the same device"), and aten's list form is the
    # one that calls cuDNN
    steps_list, lengths_list = input_lengths.tolist(), lengths.tolist()
    return lambda lp: F.ctc_loss(lp, concatenated, steps_list, lengths_list, reduction="mean")


def forward_backward(loss_of, log_probs):
    leaf = log_probs.detach().requires_grad_()

    def step():
        leaf.grad = None
        loss_of(leaf).backward()
        return leaf.grad
    return step


def run_case(name: str, case: tuple) -> list:
    from common import median_ms, rel_error
    values = case_tensors(case)
    log_probs = values["log_probs"]
    native = torch_native(values)
    expected_loss = native(log_probs)
    expected_grad = forward_backward(native, log_probs)().clone()
    providers = {"torch native": native, "torch cuDNN": torch_cudnn(values), "dnngraph": None}
    try:
        providers["dnngraph"] = dnngraph_function(values)
    except Exception as failure:  # the others' numbers still print
        providers["dnngraph"] = failure
    rows = []
    for direction in ("fwd", "fwd+bwd"):
        row, native_ms = [name, direction], None
        for provider, loss_of in providers.items():
            if loss_of is None or isinstance(loss_of, Exception):
                row.append("n/a" if loss_of is None else f"n/a: {str(loss_of)[:60]}")
                continue
            try:
                if direction == "fwd":
                    call = (lambda f: lambda: f(log_probs))(loss_of)
                    expected = expected_loss
                else:
                    call = forward_backward(loss_of, log_probs)
                    expected = expected_grad
                # cuDNN's form has every input length T: its numbers differ by design
                error = 0.0 if provider == "torch cuDNN" else rel_error(call(), expected)
                ms = median_ms(call)
                native_ms = ms if provider == "torch native" else native_ms
                flag = " (!)" if error > 1e-3 else ""
                ratio = f" ({native_ms / ms:.2f}x)" if native_ms and provider != "torch native" else ""
                row.append(f"{ms:.3f}{ratio}{flag}")
            except Exception as failure:
                row.append(f"n/a: {str(failure)[:60]}")
        rows.append(row)
    return rows


def main(argv=None):
    from common import gpu_case_names, print_table, write_json
    names = gpu_case_names("CTC loss forward and forward+backward against torch; GPU only.", CASES, argv,
                           "bench_ctc.py")
    rows = []
    for name in names:
        rows.extend(run_case(name, CASES[name]))
    header = ["case (T, N, C, S)", "pass", "torch native ms", "torch cuDNN ms (ratio)", "dnngraph ms (ratio)"]
    rows = [[f"{row[0]} {CASES[row[0]]}"] + row[1:] for row in rows]
    print_table("CTC loss, float32 log_probs, mean reduction", header, rows)
    write_json("ctc.json", {"header": header, "rows": rows})


if __name__ == "__main__":
    main()
