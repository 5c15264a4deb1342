"""training/saver.py: a checkpoint written in the background is the state when it was saved, one
write runs at a time, and a failed write raises at the next save or wait, never over an error
already raised."""

import pytest
import torch

from model import checkpoint
from model.checkpoint import Checkpoint
from tests.helpers import tiny_model
from training.saver import BackgroundSaver, host_copy


def state_of(model, optimizer=None) -> Checkpoint:
    return Checkpoint(model=model.state_dict(), model_config=model.config, data_meta={"tokenizer": "char"},
                      optimizer=optimizer and optimizer.state_dict(), step=3)


def test_the_file_holds_the_state_when_saved_though_training_changed_it_since(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros(1, 4, dtype=torch.long))[0].sum().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    moments = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    with BackgroundSaver() as saver:
        saver.save(tmp_path / "ckpt.pt", state_of(model, optimizer), also=[tmp_path / "best.pt"])
        optimizer.step()  # the next steps change the weights and moments in place while it writes
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    for name in ("ckpt.pt", "best.pt"):
        ckpt = checkpoint.load(tmp_path / name)
        assert ckpt.step == 3 and all(torch.equal(ckpt.model[k], v) for k, v in saved.items())
        assert torch.equal(ckpt.optimizer["state"][0]["exp_avg"], moments)
    assert (tmp_path / "ckpt.pt").samefile(tmp_path / "best.pt")


def test_host_copy_copies_every_tensor_and_keeps_the_rest():
    t = torch.ones(2)
    copied = host_copy({"a": [t, (t, 3)], "b": "x"})
    assert torch.equal(copied["a"][0], t) and copied["a"][0] is not t and copied["a"][1][1] == 3
    assert isinstance(copied["a"][1], tuple) and copied["b"] == "x"


def test_a_failed_write_raises_at_the_next_save_and_then_is_gone(tmp_path):
    model = tiny_model()
    saver = BackgroundSaver()
    saver.save(tmp_path / "missing" / "ckpt.pt", state_of(model))  # returns: the thread fails
    with pytest.raises(OSError, match=r"^run_dir: cannot write checkpoint .*missing/ckpt\.pt"):
        saver.save(tmp_path / "ckpt.pt", state_of(model))
    saver.wait()  # raised once; the save after it was not started
    assert not (tmp_path / "ckpt.pt").exists()


def test_the_context_raises_a_failed_write_but_never_over_an_error_already_raised(tmp_path):
    model = tiny_model()
    with pytest.raises(OSError, match="cannot write checkpoint"):
        with BackgroundSaver() as saver:
            saver.save(tmp_path / "missing" / "ckpt.pt", state_of(model))
    with pytest.raises(FloatingPointError, match="diverged"):
        with BackgroundSaver() as saver:
            saver.save(tmp_path / "missing" / "ckpt.pt", state_of(model))
            raise FloatingPointError("diverged")
    assert saver.thread is None or not saver.thread.is_alive()
