"""training/evaluation.py: a split's loss, its arguments checked once, batched as asked."""

import pytest
import torch

from tests.helpers import tiny_model
from training.evaluation import split_loss


def test_split_loss_checks_its_arguments_and_batches_as_asked():
    model = tiny_model()
    tokens = torch.randint(0, 37, (200,))
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].size(0)))
    losses = [split_loss(model, tokens, windows_per_batch=n) for n in (1, 3, 64)]
    hook.remove()
    assert widths == [1] * 9 + [3] * 3 + [9]  # 199 targets: 9 windows of 24, at most n per forward
    assert losses == pytest.approx([losses[0]] * 3, abs=1e-6)
    for bad, message in [({"tokens": tokens.float()}, "tokens must be a 1-D split of 2 token ids"),
                         ({"windows_per_batch": 0}, "windows_per_batch must be an integer >= 1"),
                         ({"kv_dtype": torch.int32}, "kv_dtype must be one of")]:
        with pytest.raises(ValueError, match=message):
            split_loss(model, **({"tokens": tokens} | bad))
