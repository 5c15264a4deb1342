"""The checkpoint format, read and written only here.

A checkpoint is one `torch.save` file holding a dict whose keys are the fields of `Checkpoint`.
It is written atomically (a temp file, then a rename) and read with `torch.load(weights_only=True)`,
which never unpickles arbitrary objects.

    save(run_dir / "ckpt.pt", Checkpoint(model=..., model_config=..., data_meta=...))
    ckpt = load(run_dir)                                  # its ckpt.pt, else best.pt
    model, ckpt = load_model(run_dir, "cpu")              # its best.pt, as a GPT in eval mode
    ckpt = init_from("path/to/gpt2")                      # a Hugging Face GPT-2 dir, or ours

and the run dirs these live in: claim_run_dir, latest_run, read_metrics.
"""

import dataclasses
import json
import math
import os
import random
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from model.config import GPTConfig
from model.device import DTYPES, decode_precision, pick_device
from model.gpt import GPT
from model.quantize import quantize_int8

try:
    import fcntl  # run-dir locks, where the OS has flock (Linux, macOS)
except ImportError:
    fcntl = None

RUN_FILES = ("ckpt.pt", "best.pt")  # what a run dir holds: the last state, and the best val loss
METRICS_FILE = "metrics.jsonl"  # one JSON record per line, written by train.py's RunLog
RUN_MARKERS = (*RUN_FILES, METRICS_FILE)  # a folder holding any of these holds a run
LOCK_FILE = ".lock"  # flock-ed by the one process training in a run dir
GPT2_DATA_META = {"tokenizer": "bpe", "vocab": None, "vocab_size": 50257}  # a GPT-2's, as data/ writes it


@dataclass
class Checkpoint:
    """What a checkpoint file holds; these field names are its keys."""

    model: dict                                  # the GPT's state dict (no `_orig_mod.` prefix)
    model_config: GPTConfig
    data_meta: dict                              # the tokenizer (a char model's vocabulary too)
    config: dict = field(default_factory=dict)   # the run's resolved Hydra config
    step: int = 0
    best_val: float = math.inf
    optimizer: dict | None = None                # training state: None in converted checkpoints
    rng: dict | None = None                      # rng_state() and the batches', to resume exactly
    converted_from: dict | None = None           # set by model.convert


def find(path, prefer: str = "ckpt.pt", option: str | None = None) -> Path:
    """A checkpoint file, or the one in a run dir: `prefer` (ckpt.pt, the last, to resume;
    best.pt to sample), else the other. `option` (ckpt, train.resume, ...) is the setting that
    gave the path, named in the errors."""
    path = Path(path).expanduser()
    said = f"{option}: " if option else ""
    if path.is_dir():
        for name in sorted(RUN_FILES, key=lambda n: n != prefer):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{said}no checkpoint ({' or '.join(RUN_FILES)}) in {path}")
    if not path.is_file():
        raise FileNotFoundError(f"{said}checkpoint not found: {path}")
    return path


def save(path, ckpt: Checkpoint) -> Path:
    """Write atomically: a temp file in the same folder, renamed over the old one. On any
    failure (a full disk, `path` a folder) the temp file goes and the old file stays; a write
    the disk refused is an OSError that says so."""
    path = Path(path)
    state = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt)}
    state["model_config"] = dataclasses.asdict(ckpt.model_config)
    state["model"] = {k.removeprefix("_orig_mod."): v for k, v in ckpt.model.items()}
    kept = "; the previous one is intact" if path.is_file() else ""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as e:
        raise type(e)(f"cannot write checkpoint {path}: {e.strerror or e}{kept}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            writer = ErrorKeepingWriter(f)
            try:
                torch.save(state, writer)
            except RuntimeError as e:  # torch reports a failed write as "unexpected pos ..."
                if writer.error is None:
                    raise
                raise writer.error from e
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 -> what open() would give
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise type(e)(f"cannot write checkpoint {path}: {e.strerror or e}{kept}") from e
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class ErrorKeepingWriter:
    """The file torch.save writes to, keeping the OSError of a refused write (a full disk), which
    torch itself turns into a RuntimeError that does not say why."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.file.flush()


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def load(path, prefer: str = "ckpt.pt", option: str | None = None) -> Checkpoint:
    """The checkpoint at `path` (a file or a run dir), its model config built and checked.
    `option` (ckpt, train.resume, ...) is the setting that gave the path, named in the errors."""
    path = find(path, prefer, option)
    said = f"{option}: " if option else ""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  not torch's, cut short, unsafe: any file may fail in any way
        raise ValueError(f"{said}cannot read checkpoint {path}: not a kvgpt checkpoint, or a damaged one "
                         f"(torch.load: {type(e).__name__})") from e
    keys = {f.name for f in dataclasses.fields(Checkpoint)}
    required = {f.name for f in dataclasses.fields(Checkpoint)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    config_keys = {f.name for f in dataclasses.fields(GPTConfig)}
    if (not isinstance(state, dict) or not required <= state.keys() <= keys
            or not isinstance(state["model"], dict) or not isinstance(state["model_config"], dict)
            or not state["model_config"].keys() <= config_keys):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{said}{path} is not a kvgpt checkpoint (it holds {found})")
    ckpt = Checkpoint(**state)
    try:
        ckpt.model_config = GPTConfig(**ckpt.model_config)
    except ValueError as e:
        raise ValueError(f"{said}{path} has an invalid model config: {e}") from e
    # Checkpoints written before save() stripped it name every weight `_orig_mod.<name>`.
    ckpt.model = {k.removeprefix("_orig_mod."): v for k, v in ckpt.model.items()}
    return ckpt


def check_resumable(ckpt: Checkpoint, config: GPTConfig, option: str) -> None:
    """A run given by `option` (train.resume=...) continues `ckpt` only with the same model
    (dropout aside) and only from a checkpoint that holds the training state."""
    for name, value in dataclasses.asdict(config).items():
        saved = getattr(ckpt.model_config, name)
        if name != "dropout" and saved != value:
            raise ValueError(f"{option}: its model has model.{name}={saved!r} but this run asks for "
                             f"{value!r}: a resumed run keeps its model (drop that override, or start "
                             f"a new run from it with init_from=...)")
    if ckpt.optimizer is None:
        raise ValueError(f"{option} holds no training state (a converted checkpoint?): start from it "
                         f"with init_from instead")


# ----------------------------------------------------------------------------- run directories

held_run_dirs: dict[Path, int] = {}  # run dir -> the open lock file descriptor this process holds


def claim_run_dir(run_dir, option: str = "hydra.run.dir") -> Path:
    """Make run_dir this process's to train in, before anything is written there. Refused when
    another process trains in it (its lock is held) or when it already holds a run; temp files
    that a process killed mid-save left there are removed. Idempotent within a process;
    release_run_dir gives it back (so does the process's exit)."""
    run_dir = Path(run_dir).expanduser().resolve()
    if run_dir in held_run_dirs:
        return run_dir
    if found := run_files(run_dir):  # checked before anything is created there, a lock file included
        raise in_use_error(run_dir, option) if in_use(run_dir) else holds_run_error(run_dir, found, option)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise type(e)(f"{option}: cannot write to {run_dir}: {e.strerror or e}") from e
    if not lock(fd):
        os.close(fd)
        raise in_use_error(run_dir, option)
    if found := run_files(run_dir):  # a run that finished there since the first look
        os.close(fd)
        raise holds_run_error(run_dir, found, option)
    unlink_temp_files(run_dir)  # ours now: no live process writes them
    held_run_dirs[run_dir] = fd
    return run_dir


def run_files(run_dir: Path) -> list[str]:
    return [name for name in RUN_MARKERS if (run_dir / name).exists()]


def in_use_error(run_dir: Path, option: str) -> ValueError:
    return ValueError(f"{option}={run_dir} is in use: another process is training there; "
                      f"write this run to another {option}")


def holds_run_error(run_dir: Path, found: list[str], option: str) -> FileExistsError:
    return FileExistsError(f"{option}={run_dir} already holds a run ({found[0]}), which this one would "
                           f"overwrite: continue it with train.resume={run_dir}, or write to another "
                           f"{option}")


def release_run_dir(run_dir) -> None:
    fd = held_run_dirs.pop(Path(run_dir).expanduser().resolve(), None)
    if fd is not None:
        os.close(fd)  # which releases the lock


def lock(fd: int) -> bool:
    """Take an exclusive lock on an open file without waiting; False if another process has it.
    Where flock does not exist (Windows), there is no lock and this says True."""
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
    is no lock file: not a run dir of ours); the lock is released on leaving."""
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
    """Whether a live process holds run_dir's lock."""
    with lock_if_free(run_dir) as got:
        return (run_dir / LOCK_FILE).is_file() and not got


def remove_stale_temp_files(run_dir) -> list[Path]:
    """Delete the temp files of saves that never finished (the process was killed) in a run dir
    of ours, while holding its lock, so no live process is writing them."""
    with lock_if_free(Path(run_dir)) as got:
        return unlink_temp_files(Path(run_dir)) if got else []


def unlink_temp_files(run_dir: Path) -> list[Path]:
    """Delete run_dir's `.ckpt.pt.*` / `.best.pt.*` temp files; the caller holds its lock."""
    temps = [p for name in RUN_FILES for p in run_dir.glob(f".{name}.*")]
    for temp in temps:
        temp.unlink(missing_ok=True)
    return temps


def latest_run(root="outputs") -> Path:
    """The run dir under `root` whose checkpoint was written last (what `python generate.py`
    samples from when no ckpt is given)."""
    checkpoints = [p for name in RUN_FILES for p in Path(root).rglob(name) if p.is_file()]
    if not checkpoints:
        raise FileNotFoundError(f"ckpt is not set and {root}/ holds no run with a checkpoint: train one "
                                f"with `python train.py`, or give ckpt=<run dir or checkpoint file>")
    return max(checkpoints, key=lambda p: p.stat().st_mtime).parent


def read_metrics(run_dir) -> list[dict]:
    """The records of a run's metrics.jsonl (train.py writes one JSON object per line)."""
    return [json.loads(line) for line in (Path(run_dir) / METRICS_FILE).read_text().splitlines()]


def seed_rngs(seed: int) -> None:
    """Seed the process-wide RNGs that rng_state() saves (CUDA's with torch's)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict:
    """Every process-wide RNG (torch, CUDA, numpy, python), as tensors and plain data."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])


def unwrap(model) -> GPT:
    """The plain GPT inside DDP and torch.compile wrappers."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def load_weights(model, weights: dict, source) -> None:
    """Load a state dict into a GPT (wrapped or not), first checking that every tensor is there
    with the shape the model's config gives it."""
    model = unwrap(model)
    expected = model.state_dict()
    for name in sorted(expected.keys() | weights.keys()):
        got, want = weights.get(name), expected.get(name)
        if got is None or want is None or got.shape != want.shape:
            describe = lambda t: "absent" if t is None else f"shape {tuple(t.shape)}"
            raise ValueError(f"{source}: weights do not match its model config ({name}: "
                             f"{describe(got)} in the checkpoint, {describe(want)} in the model)")
    model.load_state_dict(weights)


def load_model(path, device="auto", dtype: str = "auto", quantize: str | None = "auto",
               option: str = "ckpt"):
    """(the GPT of the checkpoint at `path` (a run dir's best.pt, else ckpt.pt) ready to decode,
    as `for_decoding` makes it; the Checkpoint)."""
    device = pick_device(device) if isinstance(device, str) else device
    decode_precision(device, dtype, quantize)  # the options' names are checked before loading
    ckpt = load(path, prefer="best.pt", option=option)
    model = GPT(ckpt.model_config)
    load_weights(model, ckpt.model, f"{option}={path}")
    return for_decoding(model, device, dtype, quantize), ckpt


def for_decoding(model: GPT, device, dtype: str = "auto", quantize: str | None = "auto") -> GPT:
    """The model in eval mode on `device`, in the precision `decode_precision` picks (int8
    weights when it says so)."""
    device = pick_device(device) if isinstance(device, str) else device
    dtype, quantize = decode_precision(device, dtype, quantize, model.num_params())
    if quantize == "int8":
        quantize_int8(model)
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def check_init_from(path) -> None:
    """init_from names a Hugging Face GPT-2 directory or one of our checkpoints (checked before a
    run does any work; init_from reads it)."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        find(path, prefer="best.pt", option="init_from")


def init_from(path) -> Checkpoint:
    """The checkpoint to start training from (the `init_from` option): a Hugging Face GPT-2
    directory (its weights, config and GPT-2's tokenizer), or one of our checkpoints (a run dir's
    best.pt, a converted one, ...)."""
    path = Path(path).expanduser()
    if (path / "config.json").is_file():
        model = GPT.from_pretrained(path)
        return Checkpoint(model=model.state_dict(), model_config=model.config, data_meta=GPT2_DATA_META)
    return load(path, prefer="best.pt", option="init_from")
