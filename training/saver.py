"""Checkpoints written while training goes on. `BackgroundSaver.save` copies the checkpoint's
tensors to host memory at once (a moment: the training cannot change the copy) and a thread
writes it to disk with `model.checkpoint.save` (atomic, fsync-ed: 0.5 s or more for the GPU
recipe's 128 MB, measured as 2-6 s of a 28 s run when each write held the loop up) while the next
steps run. One write at a time; a write that failed raises its error (the run dir's: `run_dir:
cannot write checkpoint ...`) at the next save or `wait`.
"""

import dataclasses
import threading

import torch

from model import checkpoint
from training.run_dir import run_dir_write


def host_copy(obj):
    """obj with every tensor in it (in dicts, lists and tuples) copied to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: host_copy(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)([host_copy(value) for value in obj])
    return obj


class BackgroundSaver:
    """Writes checkpoints on a thread of its own; a context whose exit waits for the last one
    (raising its error, unless the block already raised one)."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, path, ckpt: checkpoint.Checkpoint, also=()) -> None:
        """Start writing ckpt to path (and the names in `also`), after the last write ended."""
        self.wait()
        snapshot = checkpoint.Checkpoint(**{f.name: host_copy(getattr(ckpt, f.name))
                                            for f in dataclasses.fields(ckpt)})
        self.thread = threading.Thread(target=self.write, args=(path, snapshot, also),
                                       name="checkpoint writer")
        self.thread.start()

    def write(self, path, ckpt: checkpoint.Checkpoint, also) -> None:
        try:
            with run_dir_write():
                checkpoint.save(path, ckpt, also=also)
        except BaseException as e:  # raised in the training's thread, by wait
            self.error = e

    def wait(self) -> None:
        """Until the last write has ended; its error, if it failed, is raised here."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.wait()
        elif self.thread is not None:
            self.thread.join()  # the file complete (or its temp file gone) before the error goes on
