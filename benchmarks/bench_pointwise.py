"""Fused pointwise graphs at 16384x8192 bf16 against torch eager and torch.compile, in TB/s
over the minimal bytes (each input read once, each output written once), with the copy
ceiling measured in the same process. Also the host overhead of one execute.

    python benchmarks/bench_pointwise.py
"""
import time

import torch
import triton

import dnngraph as dg
from dnngraph.runtime import plan_cache as plan_cache
from dnngraph.target import target_of
from common import copy_ceiling_tbs, host_overhead_us, median_ms, print_table

M, N = 16384, 8192
BF16 = torch.bfloat16


def case_bias_gelu_residual():
    g = dg.Graph(name="bias_gelu_residual", io_data_type=dg.bfloat16)
    x, b, r = g.tensor(name="x", dim=[M, N]), g.tensor(name="b", dim=[1, N]), g.tensor(name="r", dim=[M, N])
    y = g.add(g.gelu(g.add(x, b)), r).set_output(True)
    data = {"x": torch.randn(M, N, device="cuda", dtype=BF16), "b": torch.randn(1, N, device="cuda", dtype=BF16),
            "r": torch.randn(M, N, device="cuda", dtype=BF16)}
    eager = lambda x, b, r: torch.nn.functional.gelu(x + b) + r
    return g, data, [y], eager


def case_sigmoid_mul():
    g = dg.Graph(name="sigmoid_mul", io_data_type=dg.bfloat16)
    x, y_in = g.tensor(name="x", dim=[M, N]), g.tensor(name="y", dim=[M, N])
    out = g.mul(g.sigmoid(x), y_in).set_output(True)
    data = {"x": torch.randn(M, N, device="cuda", dtype=BF16), "y": torch.randn(M, N, device="cuda", dtype=BF16)}
    eager = lambda x, y: torch.sigmoid(x) * y
    return g, data, [out], eager


def case_chain_two_outputs():
    g = dg.Graph(name="chain6", io_data_type=dg.bfloat16)
    x, y_in = g.tensor(name="x", dim=[M, N]), g.tensor(name="y", dim=[M, N])
    a = g.add(g.mul(x, 0.5), y_in).set_output(True)                     # 2 ops
    b = g.sub(g.mul(g.tanh(a), g.sigmoid(y_in)), x).set_output(True)     # 4 ops
    data = {"x": torch.randn(M, N, device="cuda", dtype=BF16), "y": torch.randn(M, N, device="cuda", dtype=BF16)}

    def eager(x, y):
        a = x * 0.5 + y
        return a, torch.tanh(a) * torch.sigmoid(y) - x
    return g, data, [a, b], eager


def bench_case(make, ceiling):
    g, data, outputs, eager = make()
    g.build()
    outs = {t.name: torch.empty(t.dim, device="cuda", dtype=BF16) for t in outputs}
    bindings = {**data, **outs}
    g.execute(bindings)
    ref = eager(*data.values())
    ref = ref if isinstance(ref, tuple) else (ref,)
    for t, want in zip(outputs, ref):  # bf16 vs bf16 eager: same function, rounding apart
        err = ((outs[t.name].float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, (t.name, err)
    nbytes = sum(v.numel() * v.element_size() for v in data.values()) + \
        sum(v.numel() * v.element_size() for v in outs.values())
    compiled = torch.compile(eager)
    compiled(*data.values())
    t_dg = median_ms(lambda: g.execute(bindings))
    t_eager = median_ms(lambda: eager(*data.values()))
    t_compile = median_ms(lambda: compiled(*data.values()))
    tbs = lambda ms: nbytes / ms / 1e9
    config = g.plan.launches[0].config_text
    return [g.name, f"{t_dg * 1e3:.0f}", f"{tbs(t_dg):.2f}", f"{tbs(t_dg) / ceiling:.0%}",
            f"{tbs(t_eager):.2f}", f"{tbs(t_compile):.2f}", f"{t_compile / t_dg:.2f}x",
            f"{t_eager / t_dg:.2f}x", config]


def bench_bit_packed_masks():
    """mask_out = (x > t) & mask_in at 16384x8192 bf16 x: masks one byte per element (dg.bool)
    against one bit (dg.bool_bit_packed), and torch eager on bool tensors; bytes moved and time."""
    x = torch.randn(M, N, device="cuda", dtype=BF16)
    t = torch.randn(1, N, device="cuda", dtype=BF16)
    mask = torch.rand(M, N, device="cuda") < 0.5
    rows = []
    for mask_type in (dg.bool, dg.bool_bit_packed):
        g = dg.Graph(name=f"mask_{mask_type.name}", io_data_type=dg.bfloat16)
        xs, ts = g.tensor(name="x", dim=[M, N]), g.tensor(name="t", dim=[1, N])
        ms_in = g.tensor(name="mask", dim=[M, N], data_type=mask_type)
        out = g.logical_and(g.cmp_gt(xs, ts), ms_in).set_output(True).set_data_type(mask_type)
        g.build()
        packed = mask_type.is_bit_packed
        bound_mask = dg.pack_bits(mask) if packed else mask
        result = torch.empty_like(bound_mask)
        bindings = {xs: x, ts: t, ms_in: bound_mask, out: result}
        g.execute(bindings)
        got = dg.unpack_bits(result, out.dim, out.stride) if packed else result
        assert torch.equal(got, (x > t) & mask), mask_type
        nbytes = x.numel() * x.element_size() + t.numel() * t.element_size() + 2 * bound_mask.numel()
        ms = median_ms(lambda: g.execute(bindings))
        rows.append([f"dnngraph, {mask_type.name} masks", f"{nbytes / 1e6:.0f}", f"{ms * 1e3:.0f}",
                     f"{nbytes / ms / 1e9:.2f}"])
    eager_bytes = x.numel() * x.element_size() + t.numel() * t.element_size() + 2 * mask.numel()
    ms = median_ms(lambda: (x > t) & mask)
    rows.append(["torch eager, bool masks", f"{eager_bytes / 1e6:.0f}", f"{ms * 1e3:.0f}",
                 f"{eager_bytes / ms / 1e9:.2f}"])
    return rows


def bench_host_overhead():
    g = dg.Graph(name="tiny", io_data_type=dg.float32)
    x = g.tensor(name="x", dim=[4096])
    y = g.relu(x).set_output(True)
    g.build()
    x_t = torch.randn(4096, device="cuda")
    y_t = torch.empty_like(x_t)
    bindings = {x: x_t, y: y_t}
    launch = g.plan.launches[0]
    jit_args = launch.values({x.uid: x_t, y.uid: y_t})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.neg(x_t, out=y_t)
    rows = [
        ["dnngraph execute (checks + bound launch)", f"{host_overhead_us(lambda: g.execute(bindings)):.1f}"],
        ["Triton JIT launch of the same kernel", f"{host_overhead_us(lambda: launch.kernel[(launch.programs,)](*jit_args)):.1f}"],
        ["torch eager torch.neg(x, out=y)", f"{host_overhead_us(lambda: torch.neg(x_t, out=y_t)):.1f}"],
        ["CUDA graph replay", f"{host_overhead_us(graph.replay):.1f}"],
    ]
    return rows


def sweep_configs(make):
    """Time every candidate config of the ranking model (the model's pick is rank 1)."""
    import dnngraph.backends.triton.heuristics.pointwise as heuristics

    original = heuristics.rank
    rows = []
    try:
        g, data, outputs, _ = make()
        g.build()
        space = heuristics.schedule(g.plan.groups[0], target_of()).space
        ranked = original(space, 6, target_of())
        for position, config in enumerate(ranked):
            heuristics.rank = lambda *args, _c=config: [_c]
            g2, data, outputs, _ = make()
            plan_cache.clear()  # the plan key does not see a patched function: build afresh
            g2.build()
            outs = {t.name: torch.empty(t.dim, device="cuda", dtype=BF16) for t in outputs}
            bindings = {**data, **outs}
            ms = median_ms(lambda: g2.execute(bindings))
            rows.append([position + 1, g2.plan.launches[0].config_text.split(" grid")[0],
                         f"{config.estimate_us:.0f}", f"{ms * 1e3:.0f}"])
    finally:
        heuristics.rank = original
    return rows


def main():
    ceiling = copy_ceiling_tbs(M * N)
    rows = [bench_case(make, ceiling) for make in (case_bias_gelu_residual, case_sigmoid_mul, case_chain_two_outputs)]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"copy ceiling (16384x8192 bf16, read + write): {ceiling:.2f} TB/s")
    print_table("Fused pointwise, 16384x8192 bf16 (TB/s over minimal bytes)",
                ["graph", "dnngraph us", "dnngraph TB/s", "of copy", "eager TB/s", "compile TB/s",
                 "vs compile", "vs eager", "config"], rows)
    print_table("Masks of one byte or one bit per element: (x > t) & mask, 16384x8192 bf16 x",
                ["path", "MB moved", "us", "TB/s"], bench_bit_packed_masks())
    print_table("Config sweep, bias_gelu_residual (model rank vs measured)",
                ["model rank", "config", "model us", "measured us"], sweep_configs(case_bias_gelu_residual))
    print_table("Host time per call, one-kernel graph (us, CPU-bound loop)", ["path", "us/call"],
                bench_host_overhead())


if __name__ == "__main__":
    main()
