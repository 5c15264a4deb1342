"""The command line of every entry point (train.py, generate.py, python -m data.prepare,
python -m model.convert, the attention study): the one error guard, Hydra's checks done early,
the typed view of a config node, literal prompt quoting, and the resume-config merge.

Library code raises built-in exceptions about its own arguments; `naming` renames them to the
option the user typed, and `exit_on_user_error` ends the process with `error: <one line>` and
exit code 1 (HYDRA_FULL_ERROR=1 shows the traceback). Bugs (TypeError, KeyError, torch's own
errors) are never dressed up as the user's mistake.
"""

import dataclasses
import itertools
import math
import os
import re
import signal
import sys
import threading
import typing
from contextlib import contextmanager, nullcontext
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

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


def user_error(message: str) -> str | int:
    """What a process exits with for a user error: `error: <message>`, printed, or under torchrun,
    where every process of a machine checks the same options, 1 from all but the machine's first."""
    return f"error: {message}" if int(os.environ.get("LOCAL_RANK", 0)) == 0 else 1


def exit_on_user_error(fn, *args, **kwargs):
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
        sys.exit(user_error(one_line(e)))
    finally:
        if replace:
            signal.signal(signal.SIGINT, previous)


def composed_jobs(config_dir, config_name: str, argv: list[str]) -> list[tuple[DictConfig, list[str]]]:
    """(config, overrides but Hydra's own) of each job the command line asks for (one, or each of
    a sweep's with -m), composed before @hydra.main runs so that what Hydra rejects (a wrong type, an unknown
    option or key, a malformed value) is one line and exit code 1, and so that a script can check
    every job before Hydra creates a run dir. Other flags (--cfg, --help, ...) are left to Hydra."""
    overrides = [arg for arg in argv if arg not in ("-m", "--multirun")]
    if any(arg.startswith("-") for arg in overrides) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return []
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    try:
        jobs = [overrides]
        if len(overrides) < len(argv):  # a sweep: one job per combination, as Hydra's basic sweeper
            choices = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
                       if o.is_sweep_override() else [o.input_line]
                       for o in OverridesParser.create().parse_overrides(overrides)]
            jobs = [list(job) for job in itertools.product(*choices)]
        composed = []
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            for job in jobs:
                cfg = compose(config_name, overrides=job, return_hydra_config=True)
                with open_dict(cfg):
                    del cfg["hydra"]
                composed.append((cfg, [o for o in job if not o.lstrip("+~").startswith("hydra")]))
    except (HydraException, OmegaConfBaseException) as e:
        sys.exit(user_error(hydra_one_line(e)))
    return composed


def hydra_one_line(error: BaseException) -> str:
    """Hydra's multi-line composition error as one line: what failed, why, and the options."""
    lines = [line.strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line.strip("^ ") and not line.startswith(("See https", "provider="))]
    lines = lines[:lines.index("Config search path:")] if "Config search path:" in lines else lines
    if getattr(error, "override", None):  # the grammar refused it: a quoted value is plain text
        key, _, value = error.override.partition("=")
        reason = next(line for line in lines if not line.startswith("Error parsing override"))
        return (f"cannot parse {error.override} ({reason}): quote the value for Hydra, in a shell "
                f"\"{key}='{value}'\"")
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


@contextmanager
def naming(option: str, argument: str | None = None):
    """User errors raised inside name `option`, the setting as typed: the library's name for it,
    `argument`, is replaced by it (device=cuda -> train.device=cuda), or without one the message
    is prefixed with it (train.resume: checkpoint not found: ...)."""
    try:
        yield
    except USER_ERRORS as e:
        text = str(e)
        if argument:
            text = re.sub(rf"(?<![\w.]){re.escape(argument)}\b", option, text)
        else:
            text = f"{option}: {text}"
        try:
            renamed = type(e)(text)
        except TypeError:  # an exception that takes other arguments (UnicodeDecodeError)
            renamed = ValueError(text)
        raise renamed from e


# ----------------------------------------------------------------------------- literal options

def unescape(text: str) -> str:
    """\\n and \\t as typed on a command line become a newline and a tab (\\\\ a backslash)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def quote_literal_options(argv: list[str], literal: tuple[str, ...]) -> list[str]:
    """`prompt=To be, or not` as the shell hands it over, quoted for Hydra so that commas, quotes,
    brackets, `${` and newlines are text (Hydra's grammar would reject or interpret them), for
    each key in `literal`; a typed \\n or \\t is a newline or a tab."""
    def quoted(value: str) -> str:  # in Hydra's quoted strings, \ escapes only before ' and ${
        escaped = re.sub(r"(\\*)('|\$\{|\Z)",
                         lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""), value)
        return f"'{escaped}'"

    return [f"{key}={quoted(unescape(value))}" if key in literal else arg
            for arg in argv for key, _, value in [arg.partition("=")]]


# ----------------------------------------------------------------------------- resuming a run

# What a resumed run takes from this machine, not from the checkpoint: where things are and run.
MACHINE_KEYS = ("data.cache_dir", "train.device", "train.compile", "wandb.mode")


def resumed_config(cfg: DictConfig, saved: dict, overrides: list[str], config_dir) -> DictConfig:
    """The config a resumed run continues with: the one saved in its checkpoint, except the keys
    the command line's `overrides` set and MACHINE_KEYS, which keep cfg's values. A key the saved
    config lacks (an older checkpoint) keeps cfg's value too. Saved values are resolved."""
    changed = changed_on_command_line(cfg, overrides, config_dir)
    cfg, keys = cfg.copy(), flat(OmegaConf.to_container(cfg)).keys()
    for key, value in flat(saved).items():
        if key in keys and key not in changed and key not in MACHINE_KEYS:
            OmegaConf.update(cfg, key, value, merge=False)
    print(f"train.resume: the saved config of {cfg.train.resume}, changed here: "
          f"{', '.join(sorted(changed - {'train.resume'})) or 'nothing'}", flush=True)
    return cfg


def flat(config: dict, prefix: str = "") -> dict:
    """{"a.b": leaf} for every leaf of a nested dict (lists are leaves)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_on_command_line(cfg: DictConfig, overrides: list[str], config_dir) -> set[str]:
    """The config keys the overrides set: each key typed, and every key a group option sets
    (attention=mha its four keys, ~attention what its default set), composed over the primary
    config's groups with none chosen."""
    import hydra
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser

    changed, leaves, options = set(), flat(OmegaConf.to_container(cfg)), []
    primary = OmegaConf.load(Path(config_dir) / "train.yaml").defaults
    groups = {key: option for entry in primary if not isinstance(entry, str) for key, option in entry.items()}
    ConfigStore.instance().store(name="no_groups", node={"defaults": [
        entry if isinstance(entry, str) else dict.fromkeys(entry) for entry in primary]})
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key not in groups:  # a value, or a node of values (wandb={mode: offline})
            changed |= {key} | {leaf for leaf in leaves if leaf.startswith(f"{key}.")}
        elif override.is_delete():  # ~attention: what its default set is unset
            options += [f"{key}={groups[key]}"] if groups[key] else []
        else:  # as typed: attention=mha, +attention@model=gqa, experiment=...
            options.append(override.input_line)
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    # Inside @hydra.main Hydra is initialized already; before it (the command line's checks), not.
    initialized = GlobalHydra.instance().is_initialized()
    with nullcontext() if initialized else initialize_config_dir(str(config_dir), version_base="1.3"):
        alone = hydra.compose(config_name="no_groups", overrides=options)
    return changed | flat(OmegaConf.to_container(alone)).keys()


# ----------------------------------------------------------------------------- the recipe

AUTO_RECIPES = {
    "cuda": ("shakespeare_char_gpu", "training on CUDA: the GPU recipe"),
    "cpu": ("shakespeare_char_cpu_fast", "training on the CPU: the CPU recipe, 1-3 minutes on 2 cores"),
    "mps": ("shakespeare_char_cpu_fast", "training on Apple's MPS: the CPU recipe's small model"),
}


def with_default_experiment(argv: list[str], cuda_available: bool | None = None) -> list[str]:
    """Without experiment=..., the recipe for the device the run trains on, said: train.device's
    kind when the command line sets it, else CUDA when it is available (not when resuming: a
    resumed run continues with its own config)."""
    import torch

    given = dict(a.lstrip("+").partition("=")[::2] for a in argv)
    if "experiment" in given or given.get("train.resume") not in (None, "", "null"):
        return argv
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    device = given.get("train.device", "auto").strip("'\"")
    kind = "cuda" if device.startswith("cuda") or (device == "auto" and cuda) else device
    recipe, why = AUTO_RECIPES.get(kind, AUTO_RECIPES["cpu"])
    print(f"recipe: experiment={recipe} ({why}); choose another with experiment=...", flush=True)
    return [*argv, f"experiment={recipe}"]
