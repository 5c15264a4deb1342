"""Read a corpus (the shipped TinyShakespeare or your own UTF-8 text files), split it 90/10 by
character, tokenize it with Hugging Face `datasets`, and write uint16/uint32 token arrays plus
meta.json. Idempotent, and offline: nothing is downloaded. A prepared folder is complete or not
there: written in a temp folder, synced, then renamed (a failed write leaves neither).

    python -m cli.prepare data=shakespeare_char      # or data=shakespeare_bpe, data=text_files ...

`DataConfig` is the schema of the `data` config group (configs/data/); `prepare(DataConfig)`
returns the folder of the prepared arrays and `load_prepared` reads it back.
"""

import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:
    import fcntl  # one process prepares a folder, where the OS has flock (Linux, macOS)
except ImportError:
    fcntl = None

from data.tokenizer import BPETokenizer, CharTokenizer, meta_vocab_size

FORMAT_VERSION = 3  # 2: paths with glob characters were dropped by datasets in 1; 3: meta.json's digests
TOKENIZERS = ("char", "bpe")
# TinyShakespeare (char-rnn's input.txt, 1,115,394 bytes) ships with the package: the corpus of
# data.name=shakespeare when data.path is not set.
TINYSHAKESPEARE_PATH = Path(__file__).parent / "assets" / "tinyshakespeare.txt"
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
BUILT_IN = {"shakespeare": (TINYSHAKESPEARE_PATH, TINYSHAKESPEARE_SHA256)}  # name: (file, sha256)


@dataclass
class DataConfig:
    """The `data` group: which corpus, how it is tokenized and split, where the result goes."""

    name: str = "shakespeare"  # names the prepared folder; shakespeare is also a built-in corpus
    tokenizer: str = "char"
    path: Any = None  # a file, a list of files or a glob; None: the built-in corpus `name`
    sha256: str | None = None  # of data.path's files: a corpus that does not match is never used
    cache_dir: str = "~/.cache/kvgpt"
    val_fraction: float = 0.1
    on_device: bool = True  # keep the token arrays on the training device

    def __post_init__(self):
        if self.path is not None:  # the command line may hand over a number
            self.path = [str(p) for p in self.path] if isinstance(self.path, list) else str(self.path)
        if not self.path and (self.path is not None or self.name not in BUILT_IN):
            raise ValueError(f"data.path is not set: give a text file, a list of files or a glob "
                             f"(data.name={self.name} is not a built-in corpus: {', '.join(BUILT_IN)})")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer={self.tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")
        if not str(self.cache_dir).strip():
            raise ValueError("data.cache_dir is empty: give a folder for the prepared data")
        if not re.fullmatch(r"[\w-][\w.-]*", str(self.name)):
            raise ValueError(f"data.name={self.name!r} must be a plain name (letters, digits, '_', '-', '.'; "
                             f"not starting with '.'): it names the prepared folder in data.cache_dir")



def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def meta_digest(meta: dict) -> str:
    """The sha256 of meta.json's fields but this one (`meta_sha256`), as write_prepared wrote them: a
    meta.json changed since no longer matches it."""
    return sha256_bytes(json.dumps({k: v for k, v in meta.items() if k != "meta_sha256"},
                                   sort_keys=True).encode())


def cache_dir(cfg: DataConfig) -> Path:
    return Path(os.path.expanduser(str(cfg.cache_dir)))


def corpus_files(cfg: DataConfig) -> list[Path]:
    """The corpus as local files: data.path (a file, a list, or a glob), else the shipped copy. A
    pattern means what it means to the shell (bash with globstar): `*` and `?` within a name, `**`
    any folders deep, the files it matches in sorted order (not folders, not hidden files), and the
    path as written when it matches nothing but names a file. A folder is not a file: the error
    says which pattern reads its files."""
    if cfg.path is None:
        return [BUILT_IN[cfg.name][0]]
    patterns = [cfg.path] if isinstance(cfg.path, str) else list(cfg.path)
    files = []
    for pattern in map(os.path.expanduser, patterns):
        matches = [m for m in sorted(glob.glob(pattern, recursive=True)) if os.path.isfile(m)]
        if not matches and os.path.isdir(pattern):
            raise IsADirectoryError(f"data.path={pattern} is a folder: give its files, e.g. "
                                    f"data.path='{os.path.join(pattern, '**', '*.txt')}'")
        if not matches and not os.path.isfile(pattern):
            raise FileNotFoundError(f"data.path: no such file: {pattern}")
        files += map(Path, matches or [pattern])
    return files


def read_text_files(files: list[Path]) -> bytes:
    """The files' bytes, joined; each must be UTF-8 text. The errors name the file and, for a
    binary or non-UTF-8 one, the byte offset where it stops being text."""
    parts = []
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise type(e)(f"cannot read {f}: {e.strerror or e}") from e
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{f} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset "
                             f"{e.start} (a binary file? convert text with iconv -t utf-8)") from None
        if (nul := data.find(b"\0")) >= 0:
            raise ValueError(f"{f} is binary, not text: a NUL byte at offset {nul}")
        parts.append(data)
    return b"".join(parts)


def prepare(cfg: DataConfig) -> Path:
    """Prepare the corpus described by a `data` config; returns the folder of the token arrays.
    The folder's name carries a hash of the inputs, so identical inputs are prepared once."""
    files = corpus_files(cfg)
    try:
        source = read_text_files(files)
    except (OSError, ValueError) as e:  # which file and why, as data.path's
        raise type(e)(f"data.path: {e}") from e
    source_sha256 = sha256_bytes(source)
    expected = BUILT_IN[cfg.name][1] if cfg.path is None else cfg.sha256
    if expected and source_sha256 != expected:
        fix = ("reinstall kvgpt" if cfg.path is None
               else "point data.path at a good copy, or set data.sha256=null")
        raise ValueError(f"data.sha256: {', '.join(map(str, files))} has sha256 {source_sha256}, expected "
                         f"{expected}: not used; {fix}")
    key = sha256_bytes(json.dumps([FORMAT_VERSION, source_sha256, cfg.tokenizer,
                                   cfg.val_fraction]).encode())[:16]
    out_dir = cache_dir(cfg) / f"{cfg.name}-{cfg.tokenizer}-{key}"
    if (out_dir / "meta.json").is_file() and damaged(out_dir) is None:
        return out_dir
    bpe = BPETokenizer() if cfg.tokenizer == "bpe" else None  # its errors are not the cache's
    with preparing(out_dir):
        if (out_dir / "meta.json").is_file():
            if (damage := damaged(out_dir)) is None:
                return out_dir  # another process prepared it meanwhile
            print(f"data: {out_dir} is damaged ({damage}): prepared again", file=sys.stderr)
        if out_dir.is_dir():  # damaged since (a prepared folder moves in with meta.json): made again
            shutil.rmtree(out_dir, ignore_errors=True)
        try:
            tmp_dir = Path(tempfile.mkdtemp(dir=cache_dir(cfg), prefix=f".{out_dir.name}-"))
            try:
                write_prepared(cfg, files, source, key, tmp_dir, bpe)
                sync_files(tmp_dir)
                os.replace(tmp_dir, out_dir)  # the folder is complete, or not there
            finally:
                shutil.rmtree(tmp_dir, ignore_errors=True)
        except OSError as e:
            if not (out_dir / "meta.json").is_file():  # not another process preparing the same first
                raise type(e)(f"data.cache_dir: cannot write to {cache_dir(cfg)} ({e.strerror or e})") from e
    return out_dir


@contextmanager
def preparing(out_dir: Path):
    """Held while out_dir is prepared: an flock on `.<name>.lock` beside it (where the OS has flock),
    so that one process prepares it and another waits, then finds it; holding it, the temp folders
    of a preparation that was killed (SIGKILL, a crash) are removed, since none can be live."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(out_dir.parent / f".{out_dir.name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise type(e)(f"data.cache_dir: cannot write to {out_dir.parent} ({e.strerror or e})") from e
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # (released when the fd closes, or the process ends)
            for stale in out_dir.parent.glob(f".{out_dir.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        yield
    finally:
        os.close(fd)


def sync_files(folder: Path) -> None:
    """Every file of `folder` on disk before the rename that makes it the prepared folder, as a
    checkpoint's is before its rename (a crash then leaves no folder of empty arrays)."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_prepared(cfg: DataConfig, files: list[Path], source: bytes, key: str, out_dir: Path,
                   bpe: BPETokenizer | None):
    """Tokenize and split the corpus into out_dir: train.npy, val.npy and meta.json (with `bpe`,
    else a char tokenizer built from the text). `source` is the files' bytes, which the text that
    `datasets` reads must be (line endings aside: it reads text with universal newlines)."""
    import datasets  # slow to import: only when there is work

    escaped = [glob.escape(str(f)) for f in files]  # datasets takes paths as globs, and drops what none match
    try:
        with quiet(datasets):
            corpus = datasets.load_dataset("text", data_files={"corpus": escaped}, sample_by="document",
                                           keep_linebreaks=True,
                                           cache_dir=str(cache_dir(cfg) / "hf"))["corpus"]
    except datasets.exceptions.DatasetGenerationError as e:
        if isinstance(e.__cause__, OSError):  # its cache in data.cache_dir could not be written (a full disk)
            raise e.__cause__ from e
        raise
    text = "".join(corpus["text"])
    if not text:
        raise ValueError(f"data.path: the corpus is empty: {', '.join(map(str, files))}")
    if text != source.decode().replace("\r\n", "\n").replace("\r", "\n"):
        raise ValueError(f"data.path: datasets read other text than {', '.join(map(str, files))} hold")
    tokenizer = bpe or CharTokenizer.from_text(text)

    cut = int(len(text) * (1 - cfg.val_fraction))  # first 90% of the characters train
    parts = datasets.Dataset.from_dict({"split": ["train", "val"], "text": [text[:cut], text[cut:]]})
    with quiet(datasets):
        parts = parts.map(lambda batch: {"ids": [tokenizer.encode(t) for t in batch["text"]]},
                          batched=True, remove_columns=["text"], keep_in_memory=True,
                          new_fingerprint=f"{key}-tokens")
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    counts, arrays = {}, {}
    for row in parts:
        ids, name = np.asarray(row["ids"], dtype=dtype), f"{row['split']}.npy"
        np.save(out_dir / name, ids)
        counts[f"{row['split']}_tokens"], arrays[name] = len(ids), sha256_file(out_dir / name)
    meta = {
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "vocab": tokenizer.chars if tokenizer.name == "char" else None,
        "dtype": np.dtype(dtype).name,
        **counts,
        "source_sha256": sha256_bytes(source),
        "source_files": [str(f) for f in files],
        "val_fraction": cfg.val_fraction,
        "version": FORMAT_VERSION,
        "arrays_sha256": arrays,
    }
    meta["meta_sha256"] = meta_digest(meta)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))


@contextmanager
def quiet(datasets):
    """Without `datasets`' progress bars, which count to 1 or 2 here (noise on every first run)."""
    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def load_prepared(prepared_dir: Path):
    """meta, train and val token arrays (memory-mapped) of a prepared folder, checked (check_prepared):
    a folder changed since it was prepared is refused, saying which file and how to make it again.
    (prepare, which every run and `python -m cli.prepare` call first, checks the arrays' bytes too.)"""
    prepared_dir = Path(prepared_dir)
    try:
        return read_prepared(prepared_dir)
    except ValueError as e:  # json's or numpy's complaint about a damaged file, or ours
        raise ValueError(f"{prepared_dir} is damaged ({e}): delete it and it is prepared again (by the next "
                         f"run, or python -m cli.prepare)") from e


def read_prepared(prepared_dir: Path, ids: bool = True):
    meta = json.loads((prepared_dir / "meta.json").read_text())
    train, val = (np.load(prepared_dir / f"{s}.npy", mmap_mode="r") for s in ("train", "val"))
    check_prepared(meta, train, val, ids)
    return meta, train, val


def damaged(prepared_dir: Path) -> str | None:
    """What is wrong with a prepared folder, None if nothing: load_prepared's checks, and the sha256
    of each array modified after meta.json against the one it records (a file changed in place, its
    size kept)."""
    try:  # (its ids are load_prepared's to check, once a run: an array changed since is hashed below)
        meta, _, _ = read_prepared(prepared_dir, ids=False)
    except ValueError as e:
        return str(e)
    except OSError as e:
        return f"cannot read {e.filename}: {e.strerror or e}"
    # Only an array changed after meta.json (written after them) is hashed: a run's start does not
    # read a large corpus whole for this.
    written = (prepared_dir / "meta.json").stat().st_mtime_ns
    for name, recorded in meta["arrays_sha256"].items():
        path = prepared_dir / name
        if path.stat().st_mtime_ns > written and sha256_file(path) != recorded:
            return f"{name} is not the file meta.json records: its sha256 differs"
    return None


def check_prepared(meta, train: np.ndarray, val: np.ndarray, ids: bool = True) -> None:
    """What load_prepared reads is what write_prepared writes, or a ValueError saying what is not:
    meta.json names a tokenizer whose vocabulary holds every token id of the arrays (with `ids`: a
    pass over them), their lengths and dtype, and its fields are as written (meta_sha256: no hand
    edit passes)."""
    if not isinstance(meta, dict):
        raise ValueError(f"meta.json holds a {type(meta).__name__}, not an object")
    vocab_size = meta_vocab_size(meta)
    if type(meta.get("vocab_size")) is not int or meta["vocab_size"] != vocab_size:  # (8.0, true: not ints)
        raise ValueError(f"meta.json's vocab_size {meta.get('vocab_size')!r} is not its tokenizer's "
                         f"{vocab_size}")
    for name, tokens in (("train", train), ("val", val)):
        if tokens.ndim != 1 or tokens.dtype.kind != "u" or meta.get(f"{name}_tokens") != len(tokens):
            raise ValueError(f"{name}.npy is not the {meta.get(f'{name}_tokens')!r} token ids meta.json says")
        if ids and len(tokens) and int(tokens.max()) >= vocab_size:
            raise ValueError(f"{name}.npy holds token id {int(tokens.max())}, past the vocabulary "
                             f"({vocab_size})")
        if tokens.dtype.name != meta.get("dtype"):
            raise ValueError(f"{name}.npy holds {tokens.dtype.name}, not the {meta.get('dtype')!r} "
                             f"meta.json says")
    if meta.get("meta_sha256") != meta_digest(meta):
        raise ValueError("meta.json was changed since it was prepared: its fields do not match its "
                         "meta_sha256")


if __name__ == "__main__":  # the command it was before the command lines moved to cli/
    raise SystemExit("error: data.prepare is a library module now; the command is python -m cli.prepare")
