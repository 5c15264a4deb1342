"""The checkpoint format, read and written only here. It is one `torch.save` file of a dict whose keys
are the fields of `Checkpoint`, written atomically (a temp file, then a rename) and read with
`torch.load(weights_only=True)`, which never unpickles arbitrary objects; finding one in a run dir;
and checking its weights against a model. `write_atomically` is also how every other file the
project writes is written (model/ is the layer every other imports, bar data/).
"""

import dataclasses
import math
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from model.config import GPTConfig
from model.device import on_meta
from model.gpt import GPT
from model.pretrained import FOLDER_FILES, WEIGHT_FILES, folder_family, is_finite, read_config

RUN_FILES = ("ckpt.pt", "best.pt")  # a run dir's checkpoints: the last state, and the best val loss
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


# The type of each field a checkpoint file may hold (absent: its default), checked when loaded.
FIELD_TYPES = {"data_meta": dict, "config": dict, "step": int, "best_val": (float, int),
               **dict.fromkeys(["optimizer", "rng", "converted_from"], (dict, type(None)))}


def find(path, prefer: str = "ckpt.pt") -> Path:
    """A checkpoint file, or the one in a run dir: `prefer` (ckpt.pt, the last, to resume;
    best.pt to sample), else the other. One file of a Hugging Face folder is not a model: the
    folder is (is_pretrained), and a ValueError says so."""
    path = Path(path).expanduser()
    if path.is_dir():
        for name in sorted(RUN_FILES, key=lambda n: n != prefer):
            if (path / name).is_file():
                return path / name
        hf = f", nor is it a Hugging Face model folder: it has a config.json but no weights " \
             f"({' or '.join(WEIGHT_FILES)})" if (path / "config.json").is_file() else ""
        raise FileNotFoundError(f"no checkpoint ({' or '.join(RUN_FILES)}) in {path}{hf}")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.name in FOLDER_FILES or path.suffix == ".safetensors":  # (a shard: model-00001-of-00004...)
        raise ValueError(f"{path} is one file of a Hugging Face model folder: give the folder, {path.parent}")
    return path


def latest_run(root="outputs") -> Path:
    """The run dir under `root` whose checkpoint was written last."""
    checkpoints = [p for name in RUN_FILES for p in Path(root).rglob(name) if p.is_file()]
    if not checkpoints:
        raise FileNotFoundError(f"ckpt is not set and {root}/ holds no run with a checkpoint: train one "
                                f"with `python train.py`, or give ckpt=<run dir or checkpoint file>")
    return max(checkpoints, key=lambda p: p.stat().st_mtime).parent


def save(path, ckpt: Checkpoint, also=()) -> Path:
    """Write atomically: a temp file in the same folder, renamed over the old one. On any
    failure (a full disk, `path` a folder) the temp file goes and the old file stays; a write
    the disk refused is an OSError that says so. Each path in `also` (in the same folder) becomes
    the same checkpoint, atomically too: a second name of the written file (a hard link: one
    write serves both) where the file system has them, else written again."""
    path = write(path, ckpt)
    for other in map(Path, also):
        fd, tmp = tempfile.mkstemp(dir=other.parent, prefix=f".{other.name}.")
        os.close(fd)
        os.unlink(tmp)  # (a free name for the link)
        try:
            os.link(path, tmp)
            os.replace(tmp, other)  # `other` is the old file or the new one, never neither
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            write(other, ckpt)
    return path


def write(path, ckpt: Checkpoint) -> Path:
    """One checkpoint file, written atomically (see save)."""
    state = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt)}
    state["model_config"] = dataclasses.asdict(ckpt.model_config)
    state["model"] = {k.removeprefix("_orig_mod."): v for k, v in ckpt.model.items()}
    return write_atomically(path, partial(torch_save, state), "checkpoint")


def torch_save(state: dict, file) -> None:
    writer = ErrorKeepingWriter(file)
    try:
        torch.save(state, writer)
    except RuntimeError as e:  # torch reports a failed write as "unexpected pos ..."
        if writer.error is None:
            raise
        raise writer.error from e


def write_atomically(path, write, what: str = "file") -> Path:
    """The one way the project writes a file (checkpoints, pages, plots, reports): complete or not at
    all. `write(file)` fills a temp file in path's folder (open for binary writing), which is
    fsync-ed and renamed over path. On any failure (a full disk, a file-size limit, path a folder)
    the temp file goes and the file at path stays as it was; a write the disk refused is an OSError
    `cannot write <what> <path>: <why>`, which says whether an earlier file is kept. On Linux the
    temp file has no name until it is complete (O_TMPFILE), so a process killed while writing
    leaves nothing behind; elsewhere it is `.<name>.XXXXXXXX` (a run dir's go when a run starts)."""
    path, tmp = Path(path), None
    kept = "; the previous one is intact" if path.is_file() else ""
    try:
        fd, tmp = open_temp(path)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the file
            tmp = tmp or name_unnamed(f.fileno(), path)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise type(e)(f"cannot write {what} {path}: {e.strerror or e}{kept}") from e
        raise
    return path


def open_temp(path: Path, unnamed: bool = True) -> tuple[int, str | None]:
    """(fd, its name) of a new file in path's folder, open for writing, with the permissions open()
    gives: an unnamed one where the OS and file system have them (`unnamed`; name None), which
    vanishes with the process, else a `.<name>.XXXXXXXX` of tempfile.mkstemp's."""
    if unnamed and hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
        try:
            return os.open(path.parent, os.O_TMPFILE | os.O_WRONLY, 0o666), None  # 0o666 & ~umask
        except OSError:  # not on this file system (or path's folder is not one: mkstemp says so)
            pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 -> what open() would give
    return fd, tmp


def name_unnamed(fd: int, path: Path) -> str:
    """Give the complete unnamed file `fd` a free `.<name>.XXXXXXXX` in path's folder (a second
    name for it, which os.replace then moves to path: linkat cannot replace a file)."""
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(100):
            name = f".{path.name}.{secrets.token_hex(4)}"
            try:  # a dir fd makes os.link call linkat with AT_SYMLINK_FOLLOW: the file, not /proc's link
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=folder, follow_symlinks=True)
                return str(path.parent / name)
            except FileExistsError:
                continue
        raise FileExistsError(f"no free temp file name in {path.parent}")
    finally:
        os.close(folder)


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


def load(path, prefer: str = "ckpt.pt") -> Checkpoint:
    """The checkpoint at `path` (a file or a run dir), its model config built and checked."""
    path = find(path, prefer)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # tensors read when used
    except Exception as e:  # noqa: BLE001  not torch's, cut short, unsafe: any file may fail in any way
        raise ValueError(f"cannot read checkpoint {path}: not a kvgpt checkpoint, or a damaged one "
                         f"(torch.load: {type(e).__name__})") from e
    keys = {f.name for f in dataclasses.fields(Checkpoint)}
    required = {f.name for f in dataclasses.fields(Checkpoint)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    config_keys = {f.name for f in dataclasses.fields(GPTConfig)}
    if (not isinstance(state, dict) or not required <= state.keys() <= keys
            or not isinstance(state["model"], dict) or not isinstance(state["model_config"], dict)
            or not state["model_config"].keys() <= config_keys):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path} is not a kvgpt checkpoint (it holds {found})")
    for name in FIELD_TYPES.keys() & state.keys():
        value = state[name]
        negative_step = name == "step" and isinstance(value, int) and value < 0
        if not isinstance(value, FIELD_TYPES[name]) or isinstance(value, bool) or negative_step:
            raise ValueError(f"{path} is not a kvgpt checkpoint: its {name} is {value!r:.60}")
    if not all(isinstance(t, torch.Tensor) for t in state["model"].values()):
        raise ValueError(f"{path} is not a kvgpt checkpoint: its model holds values that are not tensors")
    ckpt = Checkpoint(**state)
    try:
        ckpt.model_config = GPTConfig(**ckpt.model_config)
    except ValueError as e:
        raise ValueError(f"{path} has an invalid model config: {e}") from e
    ckpt.model = {weight_name(k): v for k, v in ckpt.model.items()}
    return ckpt


def weight_name(key: str) -> str:
    """A weight's name today, from the name an older checkpoint gives it: every name prefixed with
    `_orig_mod.` (before save() stripped it), or gpt-oss's learned sink logit as `attn.sinks` (before
    it was named apart from StreamingLLM's sink positions)."""
    key = key.removeprefix("_orig_mod.")
    return key.removesuffix(".attn.sinks") + ".attn.sink_logit" if key.endswith(".attn.sinks") else key


def unwrap(model) -> GPT:
    """The plain GPT inside DDP and torch.compile wrappers."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def check_weights(weights: dict, expected: dict) -> None:
    """`weights` holds every tensor of the state dict `expected` (a model's, or the meta tensors of
    one: shapes only), with its shape, and no other; every number of them finite."""
    for name in sorted(expected.keys() | weights.keys()):
        got, want = weights.get(name), expected.get(name)
        if got is None or want is None or got.shape != want.shape:
            describe = lambda t: "absent" if t is None else f"shape {tuple(t.shape)}"
            raise ValueError(f"weights do not match its model config ({name}: "
                             f"{describe(got)} in the checkpoint, {describe(want)} in the model)")
        if not is_finite(got):
            raise ValueError(f"its weights hold NaN or inf ({name}): a diverged run's, or a damaged file")


def expected_weights(config: GPTConfig) -> dict:
    """The state dict a GPT of `config` has, as meta tensors: shapes only, no memory, no init."""
    with on_meta():
        return GPT(config).state_dict()


def load_weights(model, weights: dict) -> None:
    """Load a state dict into a GPT (wrapped or not), checked against that model's own first."""
    model = unwrap(model)
    check_weights(weights, model.state_dict())
    model.load_state_dict(weights)


def init_from(path) -> Checkpoint:
    """The checkpoint to start training from (the `init_from` option): a Hugging Face model folder
    (pretrained_checkpoint), or one of our checkpoints (a run dir's best.pt, a converted one, ...)."""
    if is_pretrained(path):
        return pretrained_checkpoint(GPT.from_pretrained(Path(path).expanduser()), path)
    return load(path, prefer="best.pt")


def is_pretrained(path) -> bool:
    """Whether `path` is a Hugging Face model folder: a config.json and its weights (model.safetensors,
    or the index of its shards). A folder holding a checkpoint of ours (a run dir: ckpt.pt or
    best.pt) is ours, whatever else it holds."""
    path = Path(path).expanduser()
    if any((path / name).is_file() for name in RUN_FILES):
        return False
    return (path / "config.json").is_file() and any((path / name).is_file() for name in WEIGHT_FILES)


def pretrained_checkpoint(model: GPT, path) -> Checkpoint:
    """What the Hugging Face folder `path` that `model` was read from (GPT.from_pretrained) stands
    for: its weights and config, and its tokenizer: the folder's own tokenizer.json, or a GPT-2's
    vocab.json and merges.txt (data.tokenizer.HFTokenizer), or for a GPT-2 with none of them, our
    shipped copy of GPT-2's BPE. (A
    tokenizer.json that is GPT-2's BPE itself, as the Hub's GPT-2 folders hold, is the same
    tokenizer as that copy: data.tokenizer.same_tokenizer, so it finetunes on data prepared with it.)"""
    path = Path(path).expanduser()
    tokenizer = path / "tokenizer.json"
    own = tokenizer.is_file() or (path / "vocab.json").is_file()  # (GPT-2's slow tokenizer's files)
    if not own and folder_family(read_config(path), path / "config.json") == "gpt2":
        meta = GPT2_DATA_META
    else:
        meta = {"tokenizer": "hf", "path": str(tokenizer), "vocab": None, "vocab_size": None}
    return Checkpoint(model=model.state_dict(), model_config=model.config, data_meta=meta)
