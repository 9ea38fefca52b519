"""Shared benchmark helpers: timing, the copy ceiling, table printing."""
import torch
import triton


def median_ms(fn, warmup=25, rep=200) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


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
