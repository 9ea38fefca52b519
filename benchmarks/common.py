"""Shared benchmark helpers: timing, the copy ceiling, table printing."""
import torch
import triton


def median_ms(fn, warmup=25, rep=200) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def host_overhead_us(fn, iters=3000) -> float:
    """Host microseconds per call of `fn` (enqueue only; the device is synchronized around)."""
    import time

    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def copy_ceiling_tbs(numel: int, dtype=torch.bfloat16) -> float:
    """Device-to-device copy bandwidth (bytes read + written) on a tensor of `numel` elements."""
    src = torch.randn(numel, device="cuda").to(dtype)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e9


def print_table(title, header, rows):
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 over the logical elements (NaN when out has NaN)."""
    if out.numel() != ref.numel():
        raise ValueError(f"{out.numel()} elements against a reference of {ref.numel()}")
    out, ref = out.detach().reshape(-1).double(), ref.detach().to(out.device).reshape(-1).double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def write_json(filename: str, payload) -> str | None:
    """Write payload as JSON to $OUT/filename when OUT is set; returns the path written."""
    import json
    import os

    folder = os.environ.get("OUT")
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, filename)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=1, default=str)
    return path
