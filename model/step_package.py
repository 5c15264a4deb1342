"""The compiled decode step's files on disk (model/decode_step.py's). Inductor's cache folder is checked
before a compile writes to it; an int8 model's CPU step is kept there as a package (AOTInductor, its
weights frozen in).

A package is a cache of code we built, not code we trust: its name ends with the SHA-256 of its
bytes, checked before it is loaded (a damaged library would crash the process), and one that fails
is removed and built again. One package serves every length of sample (the number of cells is one
of its dynamic sizes); the most recently used PACKAGES_KEPT stay. A build runs in a folder of its own,
removed afterwards, so a failed or killed build leaves nothing half-written behind.
"""

import atexit
import contextlib
import errno
import getpass
import hashlib
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

PACKAGES_KEPT = 4  # packages kept on disk, the most recently used (each holds a model's weights)
COMPILE_NEEDS_BYTES = 2**27  # free space a compile needs in inductor's folder, besides a package
# What an OSError raised while compiling says about the folder written to (not about the compiler).
FOLDER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR,
                 errno.EEXIST, errno.EFBIG}


def inductor_folder() -> Path:
    """Where inductor keeps what it compiles: TORCHINDUCTOR_CACHE_DIR, or its default, computed as
    inductor computes it (importing inductor to ask would cost every start ~1 s)."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):  # a user id with no name (a container's)
        user = f"uid_{os.getuid()}"
    default = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return Path(os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default))


def folder_error(folder: Path, why: str) -> OSError:
    return OSError(f"cannot compile the decode step: inductor's cache folder {folder} "
                   f"(TORCHINDUCTOR_CACHE_DIR) {why}: set TORCHINDUCTOR_CACHE_DIR to a writable folder with "
                   f"room, or decode without compiling")


def writable_folder(folder: Path, need_bytes: int = COMPILE_NEEDS_BYTES) -> Path:
    """`folder`, made if missing, if it is a writable folder with need_bytes free; else one OSError
    naming it and TORCHINDUCTOR_CACHE_DIR (before a compile has spent seconds and filled the disk)."""
    if folder.exists() and not folder.is_dir():
        raise folder_error(folder, "is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise folder_error(folder, f"cannot be made ({e.strerror or e})") from e
    if not os.access(folder, os.W_OK | os.X_OK):
        raise folder_error(folder, "is not writable")
    if (free := shutil.disk_usage(folder).free) < need_bytes:
        raise folder_error(folder, f"has {free / 2**20:,.0f} MiB free, and compiling the step writes up "
                                   f"to ~{need_bytes / 2**20:,.0f} MiB")
    return folder


# What a compiler says of a write the disk refused (inductor's C++ compiles run in processes of their own).
REFUSED_WRITE_WORDS = ("No space left on device", "Disk quota exceeded", "File size limit exceeded",
                       "Read-only file system")


@contextlib.contextmanager
def folder_errors(folder: Path, clean: bool = True):
    """An error raised while compiling into `folder` that a refused write caused (inductor wraps it
    in its own, or a compiler's process says it), as one OSError naming the folder; any other error
    as it was. With `clean`, what was written there since the compile began is removed first: a
    library cut short would be loaded by a later compile (on a folder shared with other processes,
    theirs too: a cache, rebuilt when next needed)."""
    began = time.time()
    try:
        yield
    except Exception as e:  # noqa: BLE001  inductor's wrappers of the OSError, which it chains
        why = refused_write(e)
        if why is None:
            raise
        if clean:
            remove_written_since(folder, began)
        raise OSError(f"cannot compile the decode step: a write was refused ({why}) in inductor's cache "
                      f"folder {folder} (TORCHINDUCTOR_CACHE_DIR) or {tempfile.gettempdir()}: free space, "
                      f"set TORCHINDUCTOR_CACHE_DIR to another folder, or decode without compiling") from e


def refused_write(error: BaseException | None, depth: int = 0) -> str | None:
    """Why a write was refused, if that is what `error` is or was caused by: an OSError of
    FOLDER_ERRNOS, or a compiler's words for one (REFUSED_WRITE_WORDS)."""
    if error is None or depth > 20:
        return None
    if isinstance(error, OSError) and error.errno in FOLDER_ERRNOS:
        return error.strerror or str(error)
    if words := next((w for w in REFUSED_WRITE_WORDS if w in str(error)), None):
        return words
    inner = getattr(error, "inner_exception", None)
    for cause in (error.__cause__, error.__context__, inner):
        if (found := refused_write(cause, depth + 1)) is not None:
            return found
    return None


def remove_written_since(folder: Path, began: float) -> None:
    """Remove the files under `folder` modified since `began` (a compile's, cut short)."""
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                if os.stat(path := os.path.join(root, name)).st_mtime >= began:
                    os.unlink(path)


def package_key(model, cache, dynamic: list[bool], weights: bool = True) -> str:
    """The name of `model`'s step over `cache` before its content digest: a digest of all the
    package depends on. The weights (frozen in; without `weights`, a step of any weights: what
    torch.compile's code depends on), the config, each cache tensor's shape (a dynamic number of
    cells left out: one package serves every length), the cache's dtypes, the model's code,
    PyTorch's version and the CPU's vector instructions."""
    digest = hashlib.blake2b(weights_digest(model).encode() if weights else b"", digest_size=16)
    shapes = [tuple(None if d == 2 and dyn else n for d, n in enumerate(t.shape))
              for t, dyn in zip(cache.tensors, dynamic)]
    for part in (repr(model.config), repr(shapes), repr((cache.dtype, cache.compute_dtype)),
                 repr(model.wte.weight.dtype), torch.__version__, torch.backends.cpu.get_cpu_capability()):
        digest.update(part.encode())
    for source in sorted(Path(__file__).parent.rglob("*.py")):  # model/ and model/core/
        digest.update(source.read_bytes())
    return f"decode-step-{digest.hexdigest()}"


def announce_compile(folder: Path, key: str, n_layer: int) -> Path:
    """Say before a long compile (12 layers or more) that it takes a while, unless this step was
    compiled before into inductor's `folder` (its marker, `compiled-<key>`, returned: made once it is)."""
    marker = folder / "kvgpt" / f"compiled-{key}"
    if (seconds := 15 + 2.2 * n_layer) >= 40 and not marker.exists():
        print(f"kvgpt: compiling the decode step (inductor) the first time: up to ~{seconds:.0f} s for "
              f"{n_layer} layers (SmolLM2-135M's 30: 83 s on 2 cores), seconds once inductor's cache "
              f"folder {folder} holds it", file=sys.stderr, flush=True)
    return marker


def mark_compiled(marker: Path) -> None:
    with contextlib.suppress(OSError):  # (a read-only folder: said again next time)
        marker.parent.mkdir(exist_ok=True)
        marker.touch()


def weights_digest(model) -> str:
    """A digest of every weight and buffer of `model`, bytes and names (0.06 s for 43 MB)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, its first 32 hex digits (~1 GB/s); '' for one that cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(2**24):
                digest.update(chunk)
    except OSError:  # not a file, or not readable: not the package written
        return ""
    return digest.hexdigest()[:32]


def load_package(folder: Path, key: str):
    """The runner of the package `key` in `folder` whose bytes are those it was written with, or None
    where there is none. One that is not (damaged, cut short, emptied) or fails to load is removed,
    and said so; where it cannot be removed, an OSError says which file to remove."""
    for path in sorted(folder.glob(f"{key}.*.pt2")):
        if path.name == f"{key}.{file_digest(path)}.pt2":  # (a name that cannot be read digests to '')
            runner = package_runner(path)
            if runner is not None:
                with contextlib.suppress(OSError):  # (a read-only folder serves as it is)
                    os.utime(path)  # used now: pruned last
                return runner
        try:
            path.unlink(missing_ok=True)  # (missing: removed meanwhile by another process)
        except OSError as e:
            raise OSError(f"the compiled decode step {path} is damaged and cannot be removed "
                          f"({e.strerror}): remove it") from e
        print(f"kvgpt: {path} was damaged (not the bytes written): removed", file=sys.stderr)
    return None


def package_runner(path: Path):
    """The package's own C++ runner (not aoti_load_package: that imports inductor, ~3 s), or None if
    it does not load. It unpacks the package into a folder of this process's beside it, removed
    when the process exits (torch's own, in /tmp, outlived every run: 332 MB for SmolLM2-135M), or by
    a later load if the process was killed."""
    remove_stale(path.parent)
    try:
        unpacked = tempfile.mkdtemp(dir=path.parent, prefix=f".run-{os.getpid()}-")
    except OSError:  # a read-only folder: torch's temporary folder
        unpacked = None
    else:
        atexit.register(shutil.rmtree, unpacked, True)
    tmpdir = os.environ.get("TMPDIR")
    if unpacked is not None:
        os.environ["TMPDIR"] = unpacked  # where the runner unpacks (C++'s temp_directory_path)
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    except RuntimeError:
        return None
    finally:  # (as it was)
        if tmpdir is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = tmpdir


def build_package(folder: Path, key: str, export, model) -> Path:
    """Build the package `key` of `model`'s step with export(path) (model.decode_step.export_step) in
    a folder of its own, as inductor's cache too, then name it by its digest in `folder`: whole or
    absent (one package a key). Says so first (~80 s for 135M weights on 2 cores), checks the room
    it needs (~2.4 bytes a weight), and prunes older packages."""
    weights = {t.data_ptr(): t for t in model.state_dict().values()}  # (a tied head once)
    n = sum(t.numel() for t in weights.values())
    writable_folder(folder, 3 * n + COMPILE_NEEDS_BYTES)
    remove_stale(folder)
    print(f"kvgpt: compiling the int8 decode step ahead of time, once for this model and cache: about "
          f"{25 + n / 2.5e6:,.0f} s for {n / 1e6:,.1f}M weights; kept in {folder}",
          file=sys.stderr, flush=True)
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    prefix = f".build-{os.getpid()}-"
    with folder_errors(folder, clean=False), tempfile.TemporaryDirectory(dir=folder, prefix=prefix) as build:
        with temporary_cache_dir(build):
            export(Path(build) / "step.pt2")
        path = folder / f"{key}.{file_digest(Path(build) / 'step.pt2')}.pt2"
        os.replace(Path(build) / "step.pt2", path)
    for other in folder.glob(f"{key}.*.pt2"):  # (a concurrent build of the same step, bytes apart)
        if other != path:
            other.unlink(missing_ok=True)
    prune(folder)
    return path


def prune(folder: Path, keep: int = PACKAGES_KEPT) -> None:
    """Remove all but the `keep` most recently used packages in `folder` (and of the markers of
    compiled steps, empty files, all but the last 64)."""
    for pattern, kept in (("decode-step-*.pt2", keep), ("compiled-*", 64)):
        for path in sorted(folder.glob(pattern), key=last_used, reverse=True)[kept:]:
            path.unlink(missing_ok=True)


def last_used(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # (removed meanwhile by another process)
        return 0.0


def remove_stale(folder: Path) -> None:
    """Remove the folders of processes that no longer run (killed while building or decoding): their
    builds (.build-<pid>-*) and unpacked packages (.run-<pid>-*)."""
    for leftover in [*folder.glob(".build-*-*"), *folder.glob(".run-*-*")]:
        pid = leftover.name.split("-")[1]
        if pid.isdigit() and not process_runs(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it runs
        pass
    return True
