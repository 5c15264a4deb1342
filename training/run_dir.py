"""The run directory: one training run's folder, what it holds and who writes to it.

claim_run_dir makes a folder one process's to train in (a flock-ed .lock file; a folder that
holds a run is refused), MetricsLog writes metrics.jsonl (a line at a time, each whole or not at
all: append_line), wandb and the terminal, and stop_requests turns Ctrl-C and SIGTERM into a clean
stop. read_metrics reads a run's metrics back. A file of the run dir that cannot be written (a
full disk) is the run dir's error, `run_dir: cannot write ...` (run_dir_write), which the command
line names as its option.
"""

import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from model.checkpoint import RUN_FILES

try:
    import fcntl  # run-dir locks, where the OS has flock (Linux, macOS)
except ImportError:
    fcntl = None

METRICS_FILE = "metrics.jsonl"  # one JSON record per line
RUN_MARKERS = (*RUN_FILES, METRICS_FILE)  # a folder holding any of these holds a run
LOSS_PLOT = "loss.png"  # the run's loss curves, drawn at the end
LOCK_FILE = ".lock"  # flock-ed by the one process training in a run dir
WANDB_MODES = ("disabled", "offline", "online")

held_run_dirs: dict[Path, int] = {}  # run dir -> the open lock file descriptor this process holds


def claim_run_dir(run_dir) -> Path:
    """Make run_dir this process's to train in, before anything is written there. Refused when
    another process trains in it (its lock is held) or when it already holds a run; temp files
    of a save that a killed process left there are removed. Idempotent within a process;
    release_run_dir (or the process's exit) gives it back."""
    run_dir = Path(run_dir).expanduser().resolve()
    if run_dir in held_run_dirs:
        return run_dir
    if found := run_files(run_dir):  # checked before anything is created there, a lock file included
        raise in_use_error(run_dir) if in_use(run_dir) else holds_run_error(run_dir, found)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise type(e)(f"run_dir: cannot write to {run_dir}: {e.strerror or e}") from e
    if not lock(fd):
        os.close(fd)
        raise in_use_error(run_dir)
    if found := run_files(run_dir):  # a run that finished there since the first look
        os.close(fd)
        raise holds_run_error(run_dir, found)
    unlink_temp_files(run_dir)  # ours now: no live process writes them
    held_run_dirs[run_dir] = fd
    return run_dir


def run_files(run_dir: Path) -> list[str]:
    return [name for name in RUN_MARKERS if (run_dir / name).exists()]


def in_use_error(run_dir: Path) -> ValueError:
    return ValueError(f"run_dir={run_dir} is in use: another process is training there; "
                      f"write this run to another folder: run_dir=<folder>")


def holds_run_error(run_dir: Path, found: list[str]) -> FileExistsError:
    return FileExistsError(f"run_dir={run_dir} already holds a run ({found[0]}), which this one would "
                           f"overwrite: continue it with train.resume={run_dir}, or write to another "
                           f"folder: run_dir=<folder>")


def release_run_dir(run_dir) -> None:
    fd = held_run_dirs.pop(Path(run_dir).expanduser().resolve(), None)
    if fd is not None:
        os.close(fd)  # which releases the lock


def lock(fd: int) -> bool:
    """An exclusive lock on an open file, without waiting; False if another process has it.
    Where flock does not exist (Windows) there is no lock, and this says True."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextmanager
def lock_if_free(run_dir: Path):
    """Yields whether this process got run_dir's lock (False: a live process holds it, or there
    is no lock file: not a run dir of ours); released on leaving."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        yield lock(fd)
    finally:
        os.close(fd)


def in_use(run_dir: Path) -> bool:
    with lock_if_free(run_dir) as got:
        return (run_dir / LOCK_FILE).is_file() and not got


def remove_stale_temp_files(run_dir) -> list[Path]:
    """Delete the temp files of saves that never finished in a run dir of ours, while holding
    its lock, so that no live process is writing them."""
    with lock_if_free(Path(run_dir)) as got:
        return unlink_temp_files(Path(run_dir)) if got else []


def unlink_temp_files(run_dir: Path) -> list[Path]:
    """The temp files (`.<name>.*`, write_atomically's where a file cannot be unnamed: another OS or
    file system, or an older version) of the files a run writes whole, deleted."""
    temps = [p for name in (*RUN_FILES, LOSS_PLOT) for p in run_dir.glob(f".{name}.*")]
    for temp in temps:
        temp.unlink(missing_ok=True)
    return temps


@contextmanager
def run_dir_write():
    """A file of the run dir that cannot be written (OSError: a full disk) is the run dir's error."""
    try:
        yield
    except OSError as e:
        raise type(e)(f"run_dir: {e}") from e


def append_line(path: Path, line: str, sync: bool = False) -> None:
    """Append `line` and a newline to a log (one process writes it), whole or not at all: a write
    the disk refuses part-way is cut back off, so the lines before it stay as they were and no line
    is torn. Appended, not rewritten as write_atomically would: a long run's log would be copied at
    every record. `sync`: on disk before this returns."""
    data, fd, size = memoryview((line + "\n").encode()), None, None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        size = os.fstat(fd).st_size
        while data:
            data = data[os.write(fd, data):]
        if sync:
            os.fsync(fd)
    except OSError as e:
        if size is not None:
            with suppress(OSError):
                os.ftruncate(fd, size)
        kept = "; its earlier lines are intact" if size else ""
        raise type(e)(f"cannot write {path}: {e.strerror or e}{kept}") from e
    finally:
        if fd is not None:
            os.close(fd)


def json_line(record: dict) -> str:
    """The record as one line of JSON: a number that is not finite (which Python's json would write
    as NaN or Infinity, JavaScript's words, which other readers refuse) becomes null."""
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        return [finite(v) for v in value] if isinstance(value, (list, tuple)) else value
    return json.dumps(finite(record), allow_nan=False)


def read_metrics(run_dir) -> list[dict]:
    """The records of a run's metrics.jsonl, each checked: a JSON object with an integer step."""
    path, records = Path(run_dir) / METRICS_FILE, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}, line {number}: not a metrics record (a JSON object with a step): "
                             f"{line[:60]!r}")
        records.append(record)
    return records


def start_wandb(mode: str, project: str, name: str | None, run_dir: Path, config: dict):
    """The wandb run (None when mode is disabled)."""
    if mode == "disabled":
        return None
    import wandb  # seconds to import, and not on every machine: only when asked for

    try:
        return wandb.init(mode=mode, project=project, name=name, dir=str(run_dir), config=config)
    except wandb.errors.Error as e:  # (the fix first: a message of wandb's may run over lines)
        fix = " (or log locally with wandb.mode=offline)" if mode == "online" else ""
        raise ValueError(f"wandb.mode={mode}{fix}: {e}") from e


class MetricsLog:
    """Where a run's progress goes: metrics.jsonl, wandb (config["wandb"]; started at once, so
    that a missing API key stops the run before any work), and the terminal (a tqdm bar, or plain
    lines when stderr is not a terminal). Records are stamped with the seconds since it opened."""

    def __init__(self, run_dir: Path, config: dict, master: bool, step: int, max_iters: int):
        self.path, self.master, self.max_iters = run_dir / METRICS_FILE, master, max_iters
        wandb = config["wandb"]
        self.wandb = start_wandb(wandb["mode"], wandb["project"], wandb["name"], run_dir, config) \
            if master else None
        self.bar = tqdm(total=max_iters, initial=step, desc="train", dynamic_ncols=True,
                        disable=not (master and sys.stderr.isatty()))
        self.start = time.perf_counter()

    def record(self, entry: dict) -> None:
        entry["elapsed_s"] = time.perf_counter() - self.start
        if self.master:
            with run_dir_write():
                append_line(self.path, json_line(entry))
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    def training_step(self, step: int, loss: float, lr: float, tokens_per_s=None, mfu=None) -> None:
        """A training log line; tokens/s and MFU (Throughput's) where measured."""
        speed = {k: v for k, v in {"tokens_per_s": tokens_per_s, "mfu": mfu}.items() if v is not None}
        self.record({"step": step, "loss": loss, "lr": lr} | speed)
        rate = "" if tokens_per_s is None else f", {tokens_per_s:,.0f} tokens/s"
        rate += "" if mfu is None else f", MFU {mfu:.1%}"
        self.bar.set_postfix_str(f"loss={loss:.4f}, lr={lr:.2e}{rate}")
        if self.master and self.bar.disable:
            print(f"step {step}/{self.max_iters}: loss {loss:.4f}, lr {lr:.2e}{rate}", flush=True)

    def close(self) -> None:
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


class StopRequests(list):
    """The signals a run received (SIGINT, SIGTERM), which the loop checks after each step, and an
    evaluation, the whole split's loss and the sample after each batch or token."""

    def on_any_rank(self, device, step: int = 0, every: int = 1) -> bool:
        """Whether this process got one; under torchrun, whether any process did, asked when `step` is
        a multiple of `every` (it costs an all-reduce and a device sync): all stop after the same
        step, or the others would wait forever for the one that stopped."""
        if dist.is_initialized():
            if step % every:
                return False
            requested = torch.tensor(float(bool(self)), device=device)
            dist.all_reduce(requested)
            if requested.item() and not self:
                self.append(signal.SIGTERM)
        return bool(self)


@contextmanager
def stop_requests():
    """Yields the StopRequests that SIGINT and SIGTERM append to, so that an interrupted run
    saves and exits cleanly instead of dying mid-write. A second signal (a step that takes too
    long) stops at once, unsaved."""
    received = StopRequests()

    def request(signum, frame):
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        if int(os.environ.get("RANK", 0)) == 0:  # os.write: print() may be mid-write, not reentrant
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step or batch, to save "
                        f"(again: stop now, unsaved)\n".encode())

    signals = [signal.SIGTERM] + [signal.SIGINT] * (signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    previous = {sig: signal.signal(sig, request) for sig in signals}  # an ignored SIGINT stays ignored
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
