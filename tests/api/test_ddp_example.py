"""examples/ddp_train.py: DDP through torch.compile(backend="dnngraph") gives the loss curve of one
process on the global batch (split into the same shards), with DDP or with FSDP2 (fully_shard). On CPU the ranks talk over gloo and the
kernels run in Triton's interpreter; on two GPUs (NCCL) the same comparison runs at bf16."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"
TINY = ["--model", "llama", "--steps", "3", "--hidden", "32", "--layers", "1", "--seq", "8", "--batch", "4"]


WATCHDOG_S = 240  # a rank stuck this long dumps its threads' stacks and exits (ddp_train.py)


def _attempt(command: list, environment: dict):
    """(return code, output) of one run; the whole process group is killed past the limit, so
    no rank outlives the test."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=2 * WATCHDOG_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    return process.returncode, output


def _run(command: list, out: Path, env=None) -> list:
    """The losses a run writes. A run whose rank hung (seen twice on loaded 2-core CI machines in
    gloo's CPU collectives, never reproduced alone) is retried once, its stacks printed."""
    environment = {**os.environ, "DDP_TRAIN_WATCHDOG_S": str(WATCHDOG_S), **(env or {})}
    code, output = _attempt(command + ["--out", str(out)], environment)
    if code != 0 and "Timeout (" in output:
        print(f"a rank hung; its stacks:\n{output[-6000:]}\nretrying once")
        code, output = _attempt(command + ["--out", str(out)], environment)
    assert code == 0, output[-6000:]
    return json.loads(out.read_text())["losses"]


def _torchrun(processes: int) -> list:
    runner = shutil.which("torchrun")
    return [runner] if runner else [sys.executable, "-m", "torch.distributed.run"]


CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU tensors even where a GPU exists


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    """The one-process curve on the global batch, the same for DDP and FSDP2: run once a module."""
    return _run([sys.executable, str(SCRIPT), *TINY, "--shards", "2"], tmp_path_factory.mktemp("single") / "single.json",
                CPU_ONLY)


@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_two_cpu_ranks_match_one_process_on_the_global_batch(tmp_path, sharding, single_process_losses):
    env = CPU_ONLY
    single = single_process_losses
    port = "29531" if not sharding else "29533"
    ranks = _run(_torchrun(2) + ["--nproc_per_node=2", f"--master_port={port}", str(SCRIPT), *TINY, *sharding],
                 tmp_path / "ranks.json", env)
    assert len(single) == len(ranks) == 3
    assert all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(single, ranks)), (single, ranks)
    assert len(set(single)) > 1  # the steps train: the curve is not a constant


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("model, sharding", [("llama", []), ("resnet", []), ("llama", ["--fsdp"])])
def test_two_gpus_over_nccl_match_one_gpu_on_the_global_batch(tmp_path, model, sharding):
    args = ["--model", model, "--steps", "20" if not sharding else "5", "--batch", "8", *sharding]
    single = _run([sys.executable, str(SCRIPT), *args, "--shards", "2"], tmp_path / "single.json",
                  {"CUDA_VISIBLE_DEVICES": "0"})
    ranks = _run(_torchrun(2) + ["--nproc_per_node=2", "--master_port=29532", str(SCRIPT), *args],
                 tmp_path / "ddp.json")
    assert all(abs(a - b) <= 2e-2 * max(1.0, abs(a)) for a, b in zip(single, ranks)), (single, ranks)
