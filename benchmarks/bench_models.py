"""Whole models through torch.compile(backend="dnngraph") against eager torch and inductor, in one
process: a Llama-3-8B decoder layer (bf16, batch 1: prefill forward at 4096 tokens, a training
step at 4096, a decode step at KV length 8192: one token against the cache through the layer's
weights, llama_layer.decode_step) and torchvision's ResNet-50 (channels-last bf16: a training
step at N=64, inference at N=256). Each row reports the median step time, the ratios and each compile's time.

    python benchmarks/bench_models.py [--rows llama,resnet] [--seq 4096] [--no-inductor]
        [--mode reduce-overhead] [--dynamic]

--dynamic adds the Llama layer's prefill compiled once with dynamic=True and run at three sequence
lengths (seq / 4 + 1, seq / 2 - 1, seq): a row per length (the compile column: the first call at
that length), then dynamo's compile count and how many shapes the dnngraph backend specialized.

--mode reduce-overhead compiles dnngraph and inductor alike with CUDA-graph replay (cudagraph
trees); eager stays eager.
"""
import argparse
import time

import torch

import dnngraph.torch_backend  # noqa: F401  (the name "dnngraph" where the package is not installed)
from common import median_ms, print_table, write_json
from llama_layer import decode_step, make_layer


def _timed_compile(fn, warm):
    """(compiled fn, seconds to the first result): torch.compile is lazy, the first call compiles."""
    start = time.perf_counter()
    warm(fn)
    torch.cuda.synchronize()
    return fn, time.perf_counter() - start


def _row(label, step, make_variants, work_flops=None):
    """Time each variant's step; the row with ratios eager / dnngraph and inductor / dnngraph."""
    times, compile_s = {}, {}
    for name, fn in make_variants().items():
        fn, seconds = _timed_compile(fn, step)
        compile_s[name] = seconds
        times[name] = median_ms(lambda: step(fn), warmup=3, rep=20)
    dg = times["dnngraph"]
    row = [label, f"{dg:.2f}", f"{times['eager']:.2f}", f"{times.get('inductor', float('nan')):.2f}",
           f"{times['eager'] / dg:.2f}", f"{times.get('inductor', float('nan')) / dg:.2f}",
           f"{compile_s['dnngraph']:.0f}", f"{compile_s.get('inductor', float('nan')):.0f}"]
    if work_flops:
        row.append(f"{work_flops / dg / 1e9:.0f}")
    print(" | ".join(row), flush=True)
    return row


DECODE_KV = 8192  # the decode row's cache length


MODE = {"mode": "default", "backends": None}  # the torch.compile mode of both compiled variants (--mode)


def dnngraph_compile_kwargs(mode: str, backends) -> dict:
    """torch.compile's keywords for the dnngraph variant: the mode, or where --backends names the
    backends, options (torch.compile takes a mode or options, not both) replaying CUDA graphs as
    the mode would and building every graph with BuildOptions(backends=...)."""
    if not backends:
        return {"mode": mode}
    import dnngraph
    return {"options": {"cudagraphs": mode == "reduce-overhead",
                        "build_options": dnngraph.BuildOptions(backends=tuple(backends))}}


def _variants(model_fn, inductor: bool):
    """A maker of the variants of one row: eager, dnngraph's backend and (optionally) inductor,
    both compiled in MODE."""
    def make():
        made = {"eager": model_fn}
        torch._dynamo.reset()
        made["dnngraph"] = torch.compile(model_fn, backend="dnngraph", dynamic=False,
                                         **dnngraph_compile_kwargs(MODE["mode"], MODE["backends"]))
        if inductor:
            made["inductor"] = torch.compile(model_fn, dynamic=False, mode=MODE["mode"])
        return made
    return make


def _new_step():
    """A new iteration for the cudagraph trees (replayed outputs of the last step may be reused)."""
    torch.compiler.cudagraph_mark_step_begin()


def llama_cases(seq: int, inductor: bool) -> list:
    """(label, step(fn), variants()) of the Llama decoder layer's rows."""
    torch.manual_seed(0)
    layer, forward, origin = make_layer(4096, 32, 8, 14336, torch.bfloat16, "cuda")
    x = torch.randn(1, seq, 4096, device="cuda", dtype=torch.bfloat16)
    print(f"Llama-3-8B decoder layer: {origin}", flush=True)
    variants = _variants(lambda m, h: forward(m, h), inductor)

    def prefill(fn):
        _new_step()
        with torch.no_grad():
            fn(layer, x)

    leaf = x.clone().requires_grad_()
    grad = torch.randn_like(x)

    def train(fn):
        _new_step()
        fn(layer, leaf).backward(grad)

    cache = [torch.randn(1, 8, DECODE_KV, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    token = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)

    def decode(fn):
        _new_step()
        with torch.no_grad():
            fn(layer, token, *cache)

    return [(f"Llama layer prefill S{seq}", prefill, variants),
            (f"Llama layer training step S{seq}", train, variants),
            (f"Llama layer decode step KV{DECODE_KV}", decode, _variants(decode_step, inductor))]


def dynamic_lengths(seq: int) -> tuple:
    """The --dynamic rows' sequence lengths: odd sizes in three power-of-two buckets."""
    return (seq // 4 + 1, seq // 2 - 1, seq)


def llama_dynamic_rows(seq: int, inductor: bool) -> list:
    """The Llama layer's prefill compiled once with dynamic=True per variant, then timed at each
    of dynamic_lengths(seq); prints dynamo's compile count and the dnngraph backend's
    specializations (torch_backend.REPORTS) after the rows."""
    torch.manual_seed(0)
    layer, forward, _ = make_layer(4096, 32, 8, 14336, torch.bfloat16, "cuda")
    torch._dynamo.reset()
    dnngraph.torch_backend.REPORTS.clear()
    variants = {"eager": lambda m, h: forward(m, h),
                "dnngraph": torch.compile(lambda m, h: forward(m, h), backend="dnngraph", dynamic=True, mode=MODE["mode"])}
    if inductor:
        variants["inductor"] = torch.compile(lambda m, h: forward(m, h), dynamic=True, mode=MODE["mode"])
    rows, graphs = [], torch._dynamo.utils.counters["stats"]
    dnngraph_compiles = 0
    for length in dynamic_lengths(seq):
        x = torch.randn(1, length, 4096, device="cuda", dtype=torch.bfloat16)

        def prefill(fn, x=x):
            _new_step()
            with torch.no_grad():
                fn(layer, x)
        times, compile_s = {}, {}
        for name, fn in variants.items():
            before = graphs["unique_graphs"]
            _, compile_s[name] = _timed_compile(fn, prefill)
            if name == "dnngraph":
                dnngraph_compiles += graphs["unique_graphs"] - before
            times[name] = median_ms(lambda: prefill(fn), warmup=3, rep=20)
        dg = times["dnngraph"]
        row = [f"Llama layer prefill dynamic=True S{length}", f"{dg:.2f}", f"{times['eager']:.2f}",
               f"{times.get('inductor', float('nan')):.2f}", f"{times['eager'] / dg:.2f}",
               f"{times.get('inductor', float('nan')) / dg:.2f}", f"{compile_s['dnngraph']:.1f}",
               f"{compile_s.get('inductor', float('nan')):.1f}"]
        print(" | ".join(row), flush=True)
        rows.append(row)
    specialized = sum(1 for report in dnngraph.torch_backend.REPORTS if report.specialized)
    per_shape = sum(1 for report in dnngraph.torch_backend.REPORTS if report.per_shape)
    print(f"dynamic=True: dynamo compiled {dnngraph_compiles} graph(s) for the dnngraph backend over {len(rows)} "
          f"lengths; AOTAutograd traces with symbolic sizes: {per_shape}; whole compiles per shape: {specialized}",
          flush=True)
    return rows


def resnet_cases(inductor: bool) -> list:
    """(label, step(fn), variants()) of ResNet-50's rows (each step sets the model's mode)."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device="cuda", dtype=torch.bfloat16, memory_format=torch.channels_last)
    cases = []
    for label, batch, training in (("ResNet-50 training step N64", 64, True), ("ResNet-50 inference N256", 256, False)):
        x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)

        def step(fn, x=x, training=training):
            _new_step()
            if model.training != training:  # the rows share the model (train() walks every module)
                model.train(training)
            if training:
                fn(x).float().sum().backward()
            else:
                with torch.no_grad():
                    fn(x)

        cases.append((label, step, _variants(model, inductor)))
    return cases


def cases(rows: str, seq: int, inductor: bool) -> list:
    """The chosen rows' cases, in the order llama, resnet."""
    chosen = []
    if "llama" in rows:
        chosen += llama_cases(seq, inductor)
    if "resnet" in rows:
        chosen += resnet_cases(inductor)
    return chosen


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="llama,resnet")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--match", default="", help="only the rows whose label contains this")
    parser.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    parser.add_argument("--backends", default="",
                        help="comma-separated BuildOptions.backends entries for dnngraph (default: the defaults), "
                             "e.g. gluon,triton")
    parser.add_argument("--dynamic", action="store_true",
                        help="add the Llama prefill compiled once with dynamic=True at three sequence lengths")
    args = parser.parse_args()
    MODE["mode"] = args.mode
    MODE["backends"] = [entry.strip() for entry in args.backends.split(",") if entry.strip()] or None
    rows = [_row(label, step, variants) for label, step, variants in cases(args.rows, args.seq, not args.no_inductor)
            if args.match in label]
    if args.dynamic:
        rows += llama_dynamic_rows(args.seq, not args.no_inductor)
    print_table(f"whole models, ms per step, mode {args.mode} ({torch.cuda.get_device_name()})",
                ["row", "dnngraph", "eager", "inductor", "eager / dg", "inductor / dg", "dg compile s",
                 "inductor compile s"], rows)
    write_json("models.json" if args.mode == "default" else f"models_{args.mode}.json", rows)


if __name__ == "__main__":
    main()
