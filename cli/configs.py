"""Hydra, for every command line: where the configs are and their schemas, each job composed before
@hydra.main runs (so that what Hydra rejects is one line), the typed view of a config node, free
text taken as typed, and the callback that claims a run dir before Hydra writes to it.
"""

import dataclasses
import itertools
import math
import os
import re
import shlex
import sys
import typing
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from cli.errors import naming, one_line, user_error
from data.prepare import DataConfig
from model import GPTConfig
from training.options import TrainConfig
from training.run_dir import RUN_MARKERS, claim_run_dir

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# The schemas of train.yaml's groups (each group's YAML lists `schema` in its defaults).
for group, schema in {"model": GPTConfig, "data": DataConfig, "train": TrainConfig}.items():
    ConfigStore.instance().store(group=group, name="schema", node=schema)


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
    """Hydra's multi-line composition error as one line: what failed, why, and the options. Where
    the value typed may be meant as text (the grammar refused it, a comma made it a list), how to
    type it so: a hint that works as given (`as_text`)."""
    lines = [line.strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line.strip("^ ") and not line.startswith(("See https", "provider="))]
    lines = lines[:lines.index("Config search path:")] if "Config search path:" in lines else lines
    if getattr(error, "override", None):  # the grammar refused it: a quoted value is plain text
        reason = next(line for line in lines if not line.startswith("Error parsing override"))
        return f"cannot parse {error.override} ({reason}): {as_text(error.override)}"
    if ambiguous := re.fullmatch(r"Ambiguous value for argument '(.*)'", lines[0]):  # a comma
        override = ambiguous[1]
        return (f"{override} is a list of values: for a list, {override.partition('=')[0]}=[...]; for a "
                f"sweep, --multirun; for text, {as_text(override)}")
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
    and so is a required value (`???` in the YAML) left unset, a float field that is not a finite
    number (Hydra reads `inf` and `nan` as floats), and an interpolation that does not resolve."""
    schema = OmegaConf.get_type(node)
    check_keys(node.keys(), schema, prefix)
    if missing := sorted(key for key in node if OmegaConf.is_missing(node, key)):
        raise ValueError(f"{prefix}{missing[0]} is required: set it on the command line, "
                         f"e.g. {prefix}{missing[0]}=...")
    for f in dataclasses.fields(schema):
        try:
            value = node[f.name]
        except InterpolationResolutionError as e:  # `${` typed as text, perhaps
            typed = OmegaConf.to_container(node)[f.name]
            raise ValueError(f"{prefix}{f.name}={typed}: {one_line(e)}; for ${{ as text, "
                             f"{as_text(f'{prefix}{f.name}={typed}')}") from e
        if float in (f.type, *typing.get_args(f.type)) and value is not None and not math.isfinite(value):
            raise ValueError(f"{prefix}{f.name} must be a finite number, got {value}")
    return OmegaConf.to_object(node)


def check_keys(keys, schema, prefix: str = "") -> None:
    """Every key is a field of the dataclass `schema`; the message names the first that is not."""
    if extra := sorted(set(keys) - {f.name for f in dataclasses.fields(schema)}):
        raise ValueError(f"{prefix}{extra[0]} is not a field of {schema.__name__}: check the spelling "
                         f"(its fields are {', '.join(f.name for f in dataclasses.fields(schema))})")


# ----------------------------------------------------------------------------- literal options

def unescape(text: str) -> str:
    """\\n and \\t as typed on a command line become a newline and a tab (\\\\ a backslash)."""
    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def hydra_quoted(value: str) -> str:
    """value as a Hydra quoted string, whose text it is whatever it holds: commas, quotes, brackets,
    `${`, newlines (in Hydra's quoted strings, \\ escapes only before ' and ${ and the closing quote)."""
    escaped = re.sub(r"(\\*)('|\$\{|\Z)",
                     lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""), value)
    return f"'{escaped}'"


def shell_quoted(arg: str) -> str:
    """arg as one word of a POSIX shell: in double quotes, readable around Hydra's single quotes; in
    single quotes where it holds `!` (an interactive bash expands history in double quotes)."""
    if "!" in arg:
        return shlex.quote(arg)
    return '"' + re.sub(r'([\\"$`])', r"\\\1", arg) + '"'


def as_text(override: str) -> str:
    """The hint for `key=value` meant as text: the override to type in a shell, which hands Hydra
    the value quoted."""
    key, _, value = override.partition("=")
    return f"quote the value for Hydra, in a shell {shell_quoted(f'{key}={hydra_quoted(value)}')}"


def quote_literal_options(argv: list[str], literal: tuple[str, ...]) -> list[str]:
    """`prompt=To be, or not` as the shell hands it over, quoted for Hydra so that commas, quotes,
    brackets, `${` and newlines are text (Hydra's grammar would reject or interpret them), for
    each key in `literal`; a typed \\n or \\t is a newline or a tab."""
    return [f"{key}={hydra_quoted(unescape(value))}" if key in literal else arg
            for arg in argv for key, _, value in [arg.partition("=")]]


# ----------------------------------------------------------------------------- the run dir

class RunDirGuard(Callback):
    """Claims the run dir before Hydra writes its .hydra/ there, so that a run into a folder that
    holds another run, or that another process trains in, is refused before anything changes.
    Rank 0 only: under torchrun the other ranks write nothing there."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if int(os.environ.get("RANK", 0)) == 0:
            try:
                with naming("hydra.run.dir", "run_dir"):
                    claim_run_dir(config.hydra.run.dir)
            except (OSError, ValueError) as e:  # exit here: Hydra only warns about a callback's error
                sys.exit(f"error: {one_line(e)}")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        """A sweep folder that already holds runs is refused before its first job."""
        sweep_dir = Path(config.hydra.sweep.dir)
        if found := next((p for name in RUN_MARKERS for p in sweep_dir.rglob(name)), None):
            sys.exit(f"error: hydra.sweep.dir={sweep_dir} already holds runs ({found}): write this sweep "
                     f"to another hydra.sweep.dir")
