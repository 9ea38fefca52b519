"""as_function training steps (forward + backward through the derived graphs) against torch eager
and torch.compile: the Llama MLP block and a causal attention block, bf16 values between ops
as torch keeps them (intermediate_data_type bf16).
python benchmarks/bench_function.py"""
import torch

import dnngraph as dg
from common import median_ms, print_table, write_json


def mlp_graph(tokens, hidden, inner):
    g = dg.Graph(name="mlp", io_data_type=dg.bfloat16, intermediate_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[tokens, hidden])
    gate, up, down = (g.tensor(name=n, dim=d) for n, d in (("gate", [hidden, inner]), ("up", [hidden, inner]),
                                                           ("down", [inner, hidden])))
    g.matmul(g.mul(g.silu(g.matmul(x, gate)), g.matmul(x, up)), down).set_output(True)
    return g


def mlp_torch(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down


def attention_graph(b, s, h, d):
    g = dg.Graph(name="attn", io_data_type=dg.bfloat16, intermediate_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[b, s, h * d])
    ws = [g.tensor(name=n, dim=[h * d, h * d]) for n in ("wq", "wk", "wv", "wo")]
    heads = [g.transpose(g.reshape(g.matmul(x, w), [b, s, h, d]), [0, 2, 1, 3]) for w in ws[:3]]
    o, _ = g.sdpa(*heads, use_causal_mask=True)
    g.matmul(g.reshape(g.transpose(o, [0, 2, 1, 3]), [b, s, h * d]), ws[3]).set_output(True)
    return g


def attention_torch(b, s, h, d):
    def run(x, wq, wk, wv, wo):
        q, k, v = ((x @ w).view(b, s, h, d).transpose(1, 2) for w in (wq, wk, wv))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, s, h * d) @ wo
    return run


def softcap_graph(b, s, h, d, cap=30.0):
    """The same block with attention written as ops: scale, softcap tanh(s / c) * c, a causal
    mask through where on a bool input, softmax, P V (one flash kernel forward, the flash
    backward derived)."""
    g = dg.Graph(name="softcap", io_data_type=dg.bfloat16, intermediate_data_type=dg.bfloat16)
    x = g.tensor(name="x", dim=[b, s, h * d])
    ws = [g.tensor(name=n, dim=[h * d, h * d]) for n in ("wq", "wk", "wv", "wo")]
    mask = g.tensor(name="mask", dim=[s, s], data_type=dg.bool)
    q, k, v = (g.transpose(g.reshape(g.matmul(x, w), [b, s, h, d]), [0, 2, 1, 3]) for w in ws[:3])
    scores = g.mul(g.matmul(q, g.transpose(k, [0, 1, 3, 2])), d ** -0.5)
    scores = g.where(mask, g.mul(g.tanh(g.div(scores, cap)), cap), float("-inf"))
    o = g.matmul(g.softmax(scores), v)
    g.matmul(g.reshape(g.transpose(o, [0, 2, 1, 3]), [b, s, h * d]), ws[3]).set_output(True)
    return g


def softcap_torch(b, s, h, d, cap=30.0):
    def run(x, wq, wk, wv, wo, mask):
        q, k, v = ((x @ w).view(b, s, h, d).transpose(1, 2) for w in (wq, wk, wv))
        scores = (q @ k.transpose(-1, -2)) * d ** -0.5
        scores = torch.where(mask, torch.tanh(scores / cap) * cap, float("-inf"))
        o = torch.softmax(scores.float(), -1).to(v.dtype) @ v
        return o.transpose(1, 2).reshape(b, s, h * d) @ wo
    return run


def step_ms(fn, args):
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    grad = torch.randn_like(fn(*leaves))

    def step():
        out = fn(*leaves)
        torch.autograd.backward(out, grad)

    return median_ms(step, warmup=5, rep=100)


def main():
    rows = []
    cases = [("Llama MLP 4096 tokens", mlp_graph(4096, 4096, 14336), mlp_torch,
              [(4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)], 6 * 3 * 4096 * 4096 * 14336),
             ("attention block B2 S2048 H16 D128", attention_graph(2, 2048, 16, 128), attention_torch(2, 2048, 16, 128),
              [(2, 2048, 2048)] + [(2048, 2048)] * 4, None),
             ("softcap attention block (ops) B2 S2048 H16 D128", softcap_graph(2, 2048, 16, 128),
              softcap_torch(2, 2048, 16, 128), [(2, 2048, 2048)] + [(2048, 2048)] * 4, None)]
    for label, graph, eager, shapes, flops in cases:
        args = [(torch.randn(*s, device="cuda") / s[-1] ** 0.25).bfloat16() for s in shapes]
        if "softcap" in label:
            args.append(torch.ones(2048, 2048, dtype=torch.bool, device="cuda").tril())
        fn = graph.as_function()
        timings = {"dnngraph": step_ms(fn, args), "eager": step_ms(eager, args),
                   "compile": step_ms(torch.compile(eager), args)}
        row = [label] + [f"{timings[k]:.2f}" for k in ("dnngraph", "eager", "compile")]
        row += [f"{timings['eager'] / timings['dnngraph']:.2f}", f"{timings['compile'] / timings['dnngraph']:.2f}"]
        row.append(f"{flops / timings['dnngraph'] / 1e9:.0f}" if flops else "-")
        rows.append(row)
    print_table(f"training step (forward + backward), bf16, ms ({torch.cuda.get_device_name()})",
                ["case", "dnngraph", "eager", "compile", "eager / dg", "compile / dg", "dg TFLOP/s"], rows)
    write_json("function.json", rows)


if __name__ == "__main__":
    main()
