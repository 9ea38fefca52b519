"""The attention forward on short query blocks (chunked prefill, speculative decoding: Sq 17..64
against a long K/V), the table's config (its query tile cut to the rows, then the warp rule of
backends/triton/heuristics/mma.py) against the same tiles forced on 8 and on 4 warps, one process.

    python benchmarks/sweep_short_queries.py

Each output is checked against torch's SDPA (bf16, float32 math) before timing; do_bench median
over random inputs. Prints one line per shape and config: us, TFLOP/s (4*B*H*Sq*Skv*D, the
visible half for causal rows is not subtracted: Sq << Skv), the config the build chose.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402
import triton  # noqa: E402

import dnngraph as dg  # noqa: E402
from dnngraph.backends.triton.heuristics.sdpa import AttentionConfig  # noqa: E402

# (batch, heads, query rows, keys, head dim, bottom-right causal)
SHAPES = ((8, 32, 64, 4096, 128, False), (8, 32, 64, 4096, 64, False), (8, 32, 48, 8192, 128, False),
          (8, 32, 64, 4096, 128, True))
TOLERANCE = 2e-2  # bf16 outputs of unit-variance inputs


def attention_graph(q, k, v, causal: bool):
    g = dg.Graph(name="short_queries", io_data_type=dg.bfloat16, intermediate_data_type=dg.float32,
                 compute_data_type=dg.float32)
    tq, tk, tv = (g.tensor_like(x, name=n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    o = g.sdpa(tq, tk, tv, attn_scale=q.shape[-1] ** -0.5, is_inference=True,
               use_causal_mask_bottom_right=causal)[0]
    o.set_output(True).set_name("o")
    return g, {tq: q, tk: k, tv: v}, o


def timed(shape, config):
    """(us, TFLOP/s, the plan's config line) of one shape built with `config` (None: the table)."""
    b, h, sq, skv, d, causal = shape
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for s in (sq, skv, skv))
    g, bindings, o = attention_graph(q, k, v, causal)
    g.build(options=dg.BuildOptions(sdpa_config=config) if config else None)
    out = torch.full((b, h, sq, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    bindings[o] = out
    g.execute(bindings)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(),
        attn_mask=torch.ones(sq, skv, dtype=torch.bool, device="cuda").tril(skv - sq) if causal else None)
    error = (out.float() - expected).abs().max().item()
    if not error <= TOLERANCE:
        raise AssertionError(f"{shape} {config}: max error {error}")
    ms = triton.testing.do_bench(lambda: g.execute(bindings), warmup=50, rep=300)
    chosen = next((line.strip() for line in g.explain().splitlines() if "num_warps" in line), "")
    return ms * 1e3, 4 * b * h * sq * skv * d / ms / 1e9, chosen


def main():
    print(torch.cuda.get_device_name())
    for shape in SHAPES:
        block_n = 64 if shape[5] and shape[4] > 64 else 128
        for name, config in (("table", None), ("8 warps", AttentionConfig(64, block_n, 8, 3)),
                             ("4 warps", AttentionConfig(64, block_n, 4, 3))):
            us, tflops, chosen = timed(shape, config)
            b, h, sq, skv, d, causal = shape
            print(f"B{b} H{h} Sq{sq} Skv{skv} D{d}{' causal' if causal else ''} | {name} | {us:.1f} us | "
                  f"{tflops:.0f} TFLOP/s | {chosen or 'forced'}")


if __name__ == "__main__":
    main()
