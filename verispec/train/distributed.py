"""Training across processes and machines with PyTorch's own launcher (torchrun): rank and world, the
process group (gloo on CPU, NCCL on GPU), sums over ranks, and the DDP wrap of a training step.

Under torchrun (WORLD_SIZE > 1 in the environment) `init()` joins the group; without it every helper is
the identity of one process, so the single-process path is the same code. How the work splits: rank r
self-distils prompts r, r + W, ... and extracts feature shards s with s % W == r into the shared work
folder (on several machines it must be a shared filesystem); training draws the SAME global batch on
every rank (one seeded generator, as one process draws it), each rank runs rows r, r + W, ... of it, and
the loss of each rank is its sum over the global count of labels times W, so DDP's gradient average is
the global batch's mean gradient: the steps are those of one process up to float summation order.
"""

from __future__ import annotations

import datetime
import inspect
import os

import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def init(device: str = "cpu") -> str:
    """Join torchrun's process group when launched by it; -> the device this rank uses ('cuda' becomes
    this rank's own GPU, cuda:LOCAL_RANK)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or active():
        return device
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    # a long stage on rank 0 alone (the held-out evaluation) must not time the others out
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=6))
    return device


def close() -> None:
    """Leave the group together: every rank waits at a barrier before destroying it, so no rank tears down
    its gloo connections while a peer still talks on them, and the group is gone before the interpreter
    exits (gloo's threads outliving it abort the process, as a 2-process CI run once did)."""
    if active():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if active():
        dist.barrier()


def total(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over ranks (no gradient; x itself when alone)."""
    if not active():
        return x
    y = x.detach().clone()
    dist.all_reduce(y)
    return y


def my_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's rows (r, r + W, ...) of a global batch of [B, ...] tensors."""
    if world() == 1:
        return batch
    return {k: v[rank()::world()] for k, v in batch.items()}


class Step(torch.nn.Module):
    """A training step as a module, so DDP sees the forward it synchronises: forward(batch) = loss_fn(batch);
    the trained module is its child (same parameters)."""

    def __init__(self, module: torch.nn.Module, loss_fn):
        super().__init__()
        self.module, self.loss_fn = module, loss_fn

    def forward(self, batch):
        return self.loss_fn(batch)


def wrap(module: torch.nn.Module, loss_fn) -> torch.nn.Module:
    """loss_fn as a module, under DDP when several ranks train (rank 0's weights are broadcast first)."""
    step = Step(module, loss_fn)
    if not active():
        return step
    dev = next(module.parameters()).device
    # the buffers (the draft vocabulary's map, rotary frequencies) are the same on every rank: no sync at each
    # forward (torch 2.13 renamed the option and warns at the old name)
    ddp = torch.nn.parallel.DistributedDataParallel
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
               else {"broadcast_buffers": False})
    return ddp(step, device_ids=[dev.index] if dev.type == "cuda" else None, **no_sync)
