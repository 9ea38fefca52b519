"""MoE grouped GEMMs, bf16, against a loop of cuBLAS calls and torch's grouped mm (GPU only).

One process, side by side per case (E, T tokens routed top-k, K, N): the forward
out[rows of e] = token[rows of e] @ weight[e] over E experts whose rows are drawn by routing each
token to k distinct experts at random (uneven counts, as a router gives), then the weight
gradient dweight[e] = token[rows of e]^T @ dout[rows of e]. Providers:

  cuBLAS loop   one torch.mm per expert on its slice of rows (E launches; the counts on the host)
  torch grouped torch._grouped_mm(token, weight, offs=cumulative row counts) where torch has it
  dg fwd        dnngraph's moe_grouped_matmul: one kernel, the offsets read on the device
  dg wgrad      dnngraph's moe_grouped_matmul_wgrad (and the loop / torch grouped wgrad)

Throughput is TFLOP/s over 2 * rows * K * N; ratios are anchor time / dnngraph time (> 1: dnngraph
faster). Every output is checked against the cuBLAS loop before it is timed; an implementation
that fails prints "n/a: <error>" in its cell.

    python benchmarks/bench_moe.py                   # GPU: every case; $OUT/moe.json
    python benchmarks/bench_moe.py --cases mixtral   # Mixtral FC1: E=8, T=4096 top-2, K=4096, N=14336
"""
from __future__ import annotations


import torch

# (E, tokens, top_k, K, N): Mixtral 8x7B FC1 and FC2; a many-expert fine-grained layer
CASES = {
    "mixtral": (8, 4096, 2, 4096, 14336),
    "mixtral_fc2": (8, 4096, 2, 14336, 4096),
    "fine_grained": (64, 4096, 6, 2048, 1408),
}


def routed_counts(experts: int, tokens: int, top_k: int, seed: int = 0) -> list:
    """Rows per expert of `tokens` tokens each routed to `top_k` distinct experts at random."""
    generator = torch.Generator().manual_seed(seed)
    choices = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=1).indices
    return torch.bincount(choices.reshape(-1), minlength=experts).tolist()


def first_token_offsets(counts: list) -> torch.Tensor:
    starts = [0]
    for count in counts[:-1]:
        starts.append(starts[-1] + count)
    return torch.tensor(starts, dtype=torch.int32)


def cublas_loop(token, weight, counts):
    out = torch.empty(token.shape[0], weight.shape[-1], device=token.device, dtype=token.dtype)
    start = 0
    for expert, count in enumerate(counts):
        torch.mm(token[start:start + count], weight[expert], out=out[start:start + count])
        start += count
    return out


def cublas_loop_wgrad(token, dout, counts):
    dweight = torch.empty(len(counts), token.shape[1], dout.shape[1], device=token.device, dtype=token.dtype)
    start = 0
    for expert, count in enumerate(counts):
        torch.mm(token[start:start + count].t(), dout[start:start + count], out=dweight[expert])
        start += count
    return dweight


def torch_grouped(token, weight, ends):
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is None:
        raise RuntimeError("torch._grouped_mm is not in this torch")
    return grouped(token, weight, offs=ends)


def dnngraph_function(op: str, first, second, offsets):
    import dnngraph as dg
    g = dg.Graph(name=op, io_data_type=dg.bfloat16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    a, b, off = g.tensor_like(first, name="a"), g.tensor_like(second, name="b"), g.tensor_like(offsets, name="off")
    getattr(g, op)(a, b, off).set_output(True).set_name("out")
    g.build()
    return g.as_function()


def run_case(name: str, case: tuple) -> list:
    from common import median_ms, rel_error
    experts, tokens, top_k, k, n = case
    counts = routed_counts(experts, tokens, top_k)
    rows = sum(counts)
    device = "cuda"
    token = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    weight = (torch.randn(experts, k, n, device=device) / k ** 0.5).to(torch.bfloat16)
    dout = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    offsets = first_token_offsets(counts).to(device)
    ends = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    flops = 2 * rows * k * n
    table = []
    for direction, reference, providers in (
            ("fwd", lambda: cublas_loop(token, weight, counts),
             {"torch grouped": lambda: torch_grouped(token, weight, ends),
              "dnngraph": (lambda fn: lambda: fn(token, weight, offsets))(
                  dnngraph_function("moe_grouped_matmul", token, weight, offsets))}),
            ("wgrad", lambda: cublas_loop_wgrad(token, dout, counts),
             {"dnngraph": (lambda fn: lambda: fn(token, dout, offsets))(
                 dnngraph_function("moe_grouped_matmul_wgrad", token, dout, offsets))})):
        expected = reference()
        loop_ms = median_ms(reference)
        row = [name, direction, f"{flops / loop_ms / 1e9:.0f}"]
        for provider, call in providers.items():
            try:
                error = rel_error(call(), expected)
                ms = median_ms(call)
                flag = " (!)" if error > 2e-2 else ""
                row.append(f"{flops / ms / 1e9:.0f} ({loop_ms / ms:.2f}x){flag}")
            except Exception as failure:  # one provider's failure leaves the others' numbers
                row.append(f"n/a: {str(failure)[:60]}")
        table.append(row)
    return table


def main(argv=None):
    from common import gpu_case_names, print_table, write_json
    names = gpu_case_names("MoE grouped GEMMs (bf16) against a cuBLAS loop and torch._grouped_mm; GPU only.",
                           CASES, argv, "bench_moe.py")
    rows = []
    for name in names:
        rows.extend(run_case(name, CASES[name]))
    header = ["case", "pass", "cuBLAS loop TFLOP/s", "torch grouped TFLOP/s (ratio)", "dnngraph TFLOP/s (ratio)"]
    rows = [row[:3] + (row[3:] if len(row) == 5 else ["-"] + row[3:]) for row in rows]
    print_table("MoE grouped GEMM, bf16", header, rows)
    write_json("moe.json", {"header": header, "rows": rows})


if __name__ == "__main__":
    main()
