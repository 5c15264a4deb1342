"""training/options.py: an allocation that fails while training is the user's one-line error
naming what to lower, whichever allocator failed; any other error stays what it was."""

import pytest
import torch

from training.options import out_of_memory

CPU = torch.device("cpu")


def test_a_failed_allocation_names_the_batch_size_and_what_it_asked_for():
    with pytest.raises(RuntimeError, match="can't allocate memory") as raised:
        torch.empty(1 << 60, dtype=torch.uint8)  # the CPU allocator's own failure, 1 EiB
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total "
                                  "capacity of 79.19 GiB of which 1.02 GiB is free.")
    for error, said in [(raised.value, "cpu (an allocation of 1,073,741,824.00 GiB failed)"),
                        (cuda, "cpu (an allocation of 2.50 GiB failed)"), (MemoryError(), "cpu")]:
        message = str(out_of_memory(error, 4096, CPU))
        assert message.startswith(f"out of memory on {said}: lower train.batch_size=4096 (raise "
                                  f"train.grad_accum")
        assert "\n" not in message


def test_any_other_error_is_not_called_out_of_memory():
    with pytest.raises(RuntimeError) as raised:
        torch.ones(2, 3) @ torch.ones(2, 3)
    assert out_of_memory(raised.value, 4, CPU) is None
