"""The one guard of every command line (train.py, generate.py, python -m data.prepare,
python -m model.convert, the attention study), and the typed view of a config node.

Library code raises built-in exceptions whose messages name the option the user typed. A run
the user's input or machine stopped ends with `error: <one line>` and exit code 1, never a
traceback; HYDRA_FULL_ERROR=1 shows the traceback instead, for debugging. Anything else (a
TypeError, a KeyError, torch's RuntimeErrors: bugs) is not caught, so it is never dressed up
as the user's mistake; neither is a ValueError raised inside torch, since every value the user
gives is checked before it reaches torch (one that torch rejects is our bug). It lives here,
at the bottom of the import graph, because it imports nothing of the project: every entry
point can use it.
"""

import dataclasses
import math
import os
import signal
import sys
import threading
import typing

from omegaconf import OmegaConf

# What user input can cause: a bad value (ValueError, UnicodeDecodeError included), a missing
# file, a full disk or an unreachable host (OSError), a run that diverged (FloatingPointError).
USER_ERRORS = (ValueError, OSError, FloatingPointError)


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def raised_inside_torch(error: BaseException) -> bool:
    """Whether the innermost Python frame of error's traceback is in torch's own code."""
    torch = sys.modules.get("torch")
    tb = error.__traceback__
    if torch is None or tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(os.path.dirname(torch.__file__) + os.sep)


def run_guarded(fn, *args, **kwargs):
    """fn(*args, **kwargs); a user error ends the process with one line and exit code 1, Ctrl-C
    with exit code 130 and no traceback (after the `finally` blocks that clean up have run)."""
    previous = signal.getsignal(signal.SIGINT)
    replace = threading.current_thread() is threading.main_thread() and previous not in (signal.SIG_IGN, None)
    if replace:  # Ctrl-C raises KeyboardInterrupt again (not the scripts' import-time exit): cleanup runs
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:  # Ctrl-C before a run's own handler is in place: end quietly
        sys.exit(130)
    except USER_ERRORS as e:
        bug = isinstance(e, ValueError) and raised_inside_torch(e)
        if bug or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        sys.exit(f"error: {one_line(e)}")
    finally:
        if replace:
            signal.signal(signal.SIGINT, previous)


def check_command_line(config_dir, config_name: str, overrides: list[str]) -> None:
    """Compose the config from the command line's overrides before @hydra.main does, so that one
    Hydra rejects (a wrong type, an unknown option or key, a malformed value) ends with one line
    and exit code 1 like every other user error, instead of Hydra's report of 5 to 15 lines.
    Command lines with flags (--multirun, --cfg, ...) are left to Hydra."""
    if any(arg.startswith("-") for arg in overrides) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            compose(config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        sys.exit(f"error: {hydra_one_line(e)}")


def hydra_one_line(error: BaseException) -> str:
    """Hydra's multi-line composition error as one line: what failed, why, and the options."""
    lines = [line.strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line.strip("^ ") and not line.startswith(("See https", "provider="))]
    lines = lines[:lines.index("Config search path:")] if "Config search path:" in lines else lines
    if error.__cause__ is not None:
        return f"{lines[0].rstrip('.')}: {one_line(error.__cause__)}"
    for i, line in enumerate(lines):
        if line.startswith("Available options in"):
            options = ", ".join(o for o in lines[i + 1:] if o != "schema")
            return f"{lines[0]} ({line.removeprefix('Available ').rstrip(':')}: {options})"
    quote = " (quote a value that holds special characters: key='...')" if "Exception:" in lines[0] else ""
    return "; ".join(lines) + quote


def config_object(node, prefix: str = ""):
    """The dataclass instance of a config node that has a schema (its __post_init__ checks the
    ranges). A key the schema lacks, added with `+key=...`, is an error instead of being dropped,
    and so is a required value (`???` in the YAML) left unset, and a float field that is not a
    finite number (Hydra reads `inf` and `nan` as floats)."""
    schema = OmegaConf.get_type(node)
    check_keys(node.keys(), schema, prefix)
    if missing := sorted(key for key in node if OmegaConf.is_missing(node, key)):
        raise ValueError(f"{prefix}{missing[0]} is required: set it on the command line, "
                         f"e.g. {prefix}{missing[0]}=...")
    for f in dataclasses.fields(schema):
        value = node[f.name]
        if float in (f.type, *typing.get_args(f.type)) and value is not None and not math.isfinite(value):
            raise ValueError(f"{prefix}{f.name} must be a finite number, got {value}")
    return OmegaConf.to_object(node)


def check_keys(keys, schema, prefix: str = "") -> None:
    """Every key is a field of the dataclass `schema`; the message names the first that is not."""
    if extra := sorted(set(keys) - {f.name for f in dataclasses.fields(schema)}):
        raise ValueError(f"{prefix}{extra[0]} is not a field of {schema.__name__}: check the spelling "
                         f"(its fields are {', '.join(f.name for f in dataclasses.fields(schema))})")
