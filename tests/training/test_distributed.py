"""The process group's end (training/distributed.py), in this process: a group of one."""

import gc
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training.distributed import end_distributed


def test_leaving_the_group_frees_a_ddp_wrapper_first_even_after_gc_freeze():
    """train.py freezes the collector as it exits (gc.freeze); end_distributed, at exit after it,
    still frees a DDP wrapper caught in a reference cycle while its group lives (one freed after the
    group is destroyed hangs or aborts the process)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapper = DistributedDataParallel(torch.nn.Linear(2, 2))
        cycle = [wrapper]
        cycle.append(cycle)
        group_alive_when_freed = []
        weakref.finalize(wrapper, lambda: group_alive_when_freed.append(dist.is_initialized()))
        del wrapper, cycle
        gc.freeze()
        end_distributed()
        assert group_alive_when_freed == [True] and not dist.is_initialized()
    finally:
        gc.unfreeze()
        if dist.is_initialized():
            dist.destroy_process_group()
