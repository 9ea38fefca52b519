"""Data-parallel training through torch.compile(backend="dnngraph"): a small Llama-style model or a
small ResNet, DDP (or FSDP2's fully_shard with --fsdp) over NCCL (GPUs) or gloo (CPU, kernels
through Triton's interpreter).

    torchrun --nproc_per_node=2 examples/ddp_train.py --model llama --steps 20 --out ddp.json
    torchrun --nproc_per_node=2 examples/ddp_train.py --model llama --steps 5 --fsdp
    python examples/ddp_train.py --model llama --steps 20 --shards 2 --out single.json

Every step draws the same global batch on every rank (seeded by the step); rank r trains on shard
r of it. Run as one process, --shards N splits the global batch the same way and averages the
shards' losses before one backward: the gradients DDP averages over N ranks (batch norm then sees
the same per-shard statistics as each rank does). The losses printed (and written as JSON with
--out) are the global batch's mean loss per step, so the two runs' curves can be compared.
"""
import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dnngraph.torch_backend  # noqa: E402,F401  (the backend's name where the package is not installed)


class TinyLlama(torch.nn.Module):
    """Decoder layers of llama_layer.DecoderLayer and a linear head (a regression target)."""

    def __init__(self, hidden, heads, kv_heads, inner, layers):
        super().__init__()
        from llama_layer import DecoderLayer

        self.layers = torch.nn.ModuleList(DecoderLayer(hidden, heads, kv_heads, inner) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        cos, sin = self.layers[0].rope(x.shape[1], x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(x)


class TinyResNet(torch.nn.Module):
    """A stem, two residual blocks with batch norm (one strided) and a linear classifier."""

    def __init__(self, width, classes):
        super().__init__()

        def conv_bn(cin, cout, stride=1):
            return torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(cout))

        self.stem = conv_bn(3, width)
        self.block1 = torch.nn.ModuleList([conv_bn(width, width), conv_bn(width, width)])
        self.block2 = torch.nn.ModuleList([conv_bn(width, 2 * width, 2), conv_bn(2 * width, 2 * width)])
        self.down = torch.nn.Sequential(torch.nn.Conv2d(width, 2 * width, 1, 2, bias=False),
                                        torch.nn.BatchNorm2d(2 * width))
        self.fc = torch.nn.Linear(2 * width, classes)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(self.block1[1](torch.relu(self.block1[0](x))) + x)
        x = torch.relu(self.block2[1](torch.relu(self.block2[0](x))) + self.down(x))
        return self.fc(x.mean((2, 3)))


def make_model(args, device, dtype):
    torch.manual_seed(0)  # the same weights on every rank and in the single-process run
    if args.model == "llama":
        model = TinyLlama(args.hidden, 4, 2, 2 * args.hidden, args.layers)
    else:
        model = TinyResNet(args.hidden, 10)
    memory_format = torch.channels_last if args.model == "resnet" else torch.preserve_format
    return model.to(device=device, dtype=dtype, memory_format=memory_format)


def global_batch(args, step, device, dtype):
    """(inputs, targets) of the step's global batch, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    if args.model == "llama":
        x = torch.randn(args.batch, args.seq, args.hidden, generator=generator)
        target = torch.randn(args.batch, args.seq, args.hidden, generator=generator)
    else:
        x = torch.randn(args.batch, 3, args.image, args.image, generator=generator)
        target = torch.randint(0, 10, (args.batch,), generator=generator)
    x = x.to(device=device, dtype=dtype)
    if args.model == "resnet":
        x = x.contiguous(memory_format=torch.channels_last)
    return x, (target.to(device=device, dtype=dtype) if target.is_floating_point() else target.to(device))


def loss_of(args, out, target):
    if args.model == "llama":
        return torch.nn.functional.mse_loss(out.float(), target.float())
    return torch.nn.functional.cross_entropy(out.float(), target)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama", "resnet"], default="llama")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--image", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="default: bfloat16 on GPUs, float32 on CPU")
    parser.add_argument("--backend", choices=["dnngraph", "eager"], default="dnngraph")
    parser.add_argument("--shards", type=int, default=1, help="single process: shards of the global batch")
    parser.add_argument("--fsdp", action="store_true", help="shard parameters with FSDP2 (fully_shard) instead of DDP")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if os.environ.get("DDP_TRAIN_WATCHDOG_S"):  # a rank stuck this long prints every thread's stack and exits
        faulthandler.dump_traceback_later(float(os.environ["DDP_TRAIN_WATCHDOG_S"]), exit=True)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    cuda = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    shards = world if distributed else args.shards
    if args.batch % shards:
        parser.error(f"--batch {args.batch} must divide into {shards} shards")

    model = make_model(args, device, dtype)
    trained = model
    if distributed and args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in getattr(model, "layers", []):
            fully_shard(block, mesh=mesh)
        trained = fully_shard(model, mesh=mesh)
    elif distributed:
        trained = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    step_fn = trained if args.backend == "eager" else torch.compile(trained, backend="dnngraph", dynamic=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    losses, started = [], None
    for step in range(args.steps):
        x, target = global_batch(args, step, device, dtype)
        pieces = list(zip(x.chunk(shards), target.chunk(shards)))
        mine = [pieces[rank]] if distributed else pieces
        optimizer.zero_grad(set_to_none=True)
        loss = sum(loss_of(args, step_fn(xs), ts) for xs, ts in mine) / len(mine)
        loss.backward()
        optimizer.step()
        reported = loss.detach().float().clone()
        if distributed:
            dist.all_reduce(reported)
            reported /= world
        losses.append(reported.item())
        if step == 0:
            started = time.perf_counter()  # the first step compiles
        if rank == 0:
            print(f"step {step:3d} loss {losses[-1]:.6f}", flush=True)
    elapsed = time.perf_counter() - started if args.steps > 1 else float("nan")
    samples = args.batch * (args.seq if args.model == "llama" else 1) * (args.steps - 1)
    unit = "tokens" if args.model == "llama" else "images"
    if rank == 0:
        per_gpu = samples / elapsed / world
        print(f"{unit}/s per {'GPU' if cuda else 'process'}: {per_gpu:.1f} ({world} x {device.type}, {args.backend})")
        if args.out:
            Path(args.out).write_text(json.dumps({"losses": losses, "world": world, "per_device_rate": per_gpu,
                                                  "unit": unit, "backend": args.backend}))
    if distributed:
        dist.barrier()  # no rank tears down while another still talks
        dist.destroy_process_group()
        # The run's results are out; end without running the remaining destructors. A gloo group
        # freed with main()'s locals joins its worker threads while holding the GIL, and a worker
        # that waits for the GIL then deadlocks the rank (seen on loaded 2-core machines: a rank
        # stuck after its last step with its main frame gone and one frameless thread).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
