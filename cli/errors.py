"""The one error guard of every command line (train.py, generate.py, python -m cli.prepare,
python -m cli.convert, the attention study, the benchmarks), `naming`, which says which option an
error is about, and `ArgumentParser`, argparse's parser with its errors as one line too.

Library code raises built-in exceptions about its own arguments; `naming` renames them to the
option the user typed, and `exit_on_user_error` ends the process with `error: <one line>` and
exit code 1 (HYDRA_FULL_ERROR=1 shows the traceback). Bugs (TypeError, KeyError, torch's own
errors) are never dressed up as the user's mistake.
"""

import argparse
import os
import re
import signal
import sys
import threading
import time
from contextlib import contextmanager

# What user input can cause: a bad value (ValueError, UnicodeDecodeError included), a missing
# file, a full disk or an unreachable host (OSError), a run that diverged (FloatingPointError),
# more memory than the machine lets it have (MemoryError: training.options.out_of_memory's).
USER_ERRORS = (ValueError, OSError, FloatingPointError, MemoryError)


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


# Under torchrun, how long the processes after a machine's first wait before exiting on a user error.
LATER_RANKS_WAIT_S = 5.0


def user_error(message: str) -> str | int:
    """What a process exits with for a user error: `error: <message>`, printed, or under torchrun,
    where every process of a machine checks the same options, 1 from all but the machine's first.
    Those wait first: torchrun stops every process as soon as one fails, and one failing before the
    first has printed its line would stop it unsaid (the first's exit stops them at once)."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        return f"error: {message}"
    time.sleep(LATER_RANKS_WAIT_S)
    return 1


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


@contextmanager
def naming(option: str, argument: str | None = None):
    """User errors raised inside name `option`, the setting as typed. With `argument`, the
    library's name for it, each whole `argument` (no letter, digit, `_`, `.` or `-` right before
    it) that names the option becomes `option`: one followed by `=` (device=cpu ->
    train.device=cpu), by `.` and a field (GPTConfig.n_embd -> model.n_embd), or opening the
    message as its subject (run_dir: cannot write ... -> hydra.run.dir: cannot write ...). The
    same word anywhere else is prose and stays (a machine with 1 CUDA device, the device's memory).
    Without `argument` the message is prefixed with `option` (train.resume: checkpoint not found)."""
    try:
        yield
    except USER_ERRORS as e:
        text = str(e)
        if argument:
            name = rf"(?<![\w.-]){re.escape(argument)}"
            text = re.sub(rf"\A{name}(?=[:\s])|{name}(?==|\.\w)", option, text)
        else:
            text = f"{option}: {text}"
        if text == str(e):  # not about the option: raised as it was (a bug inside torch stays one)
            raise
        try:
            renamed = type(e)(text)
        except TypeError:  # an exception that takes other arguments (UnicodeDecodeError)
            renamed = ValueError(text)
        raise renamed from e


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser for the command lines that take --options (python -m cli.convert, the
    benchmarks): what it rejects itself (a missing argument, a value not of its type) is one line
    and exit code 1 as well, `error: argument --threads: invalid int value: 'x'` (argparse's own
    prints its usage first and exits 2)."""

    def error(self, message):
        sys.exit(user_error(message))
