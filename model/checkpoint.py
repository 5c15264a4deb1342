"""The checkpoint format, read and written only here.

A checkpoint is one `torch.save` file holding a dict whose keys are the fields of `Checkpoint`.
It is written atomically (a temp file, then a rename) and read with `torch.load(weights_only=True)`,
which never unpickles arbitrary objects.

    save(run_dir / "ckpt.pt", Checkpoint(model=..., model_config=..., data_meta=...))
    ckpt = load(run_dir)                                  # its ckpt.pt, else best.pt
    model, ckpt = load_model(run_dir, "cpu")              # its best.pt, as a GPT in eval mode
    config, weights = init_from("path/to/gpt2")           # a Hugging Face GPT-2 dir or ours
"""

import dataclasses
import math
import os
import pickle
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from model.config import GPTConfig
from model.device import check_dtype, pick_device
from model.gpt import GPT
from model.quantize import quantize_int8

RUN_FILES = ("ckpt.pt", "best.pt")  # what a run dir holds: the last state, and the best val loss


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
    failure (a full disk, `path` a folder) the temp file goes and the old file stays."""
    path = Path(path)
    state = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt)}
    state["model_config"] = dataclasses.asdict(ckpt.model_config)
    state["model"] = {k.removeprefix("_orig_mod."): v for k, v in ckpt.model.items()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 -> what open() would give
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:  # not torch's, cut short, or unsafe
        raise ValueError(f"{said}cannot read checkpoint {path}: {type(e).__name__}: {e}") from e
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
            raise ValueError(f"checkpoint {option} has model.{name}={saved!r} but this run asks for "
                             f"{value!r}: resume with the checkpoint's model settings")
    if ckpt.optimizer is None:
        raise ValueError(f"{option} holds no training state (a converted checkpoint?): start from it "
                         f"with init_from instead")


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


def load_model(path, device="auto", dtype: str = "float32", quantize: str | None = None,
               option: str = "ckpt"):
    """(the GPT of the checkpoint at `path` (a run dir's best.pt, else ckpt.pt), in eval mode, on
    `device`, in `dtype`, with int8 weights if quantize="int8"; the Checkpoint)."""
    torch_dtype = check_dtype(dtype)
    check_quantize(quantize)
    ckpt = load(path, prefer="best.pt", option=option)
    model = GPT(ckpt.model_config)
    load_weights(model, ckpt.model, f"{option}={path}")
    if quantize == "int8":
        quantize_int8(model)
    device = pick_device(device) if isinstance(device, str) else device
    return model.to(device=device, dtype=torch_dtype).eval(), ckpt


def check_quantize(quantize: str | None) -> None:
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be null or int8, got {quantize!r}")


def init_from(path) -> tuple[GPTConfig, dict]:
    """The architecture and weights to start training from (the `init_from` option): a Hugging
    Face GPT-2 directory, or one of our checkpoints (a run dir's best.pt, a converted one, ...)."""
    path = Path(path).expanduser()
    if (path / "config.json").is_file():
        model = GPT.from_pretrained(path)
        return model.config, model.state_dict()
    ckpt = load(path, prefer="best.pt", option="init_from")
    return ckpt.model_config, ckpt.model
