"""Runs shell commands one after another, as a user types them in one folder, each `python <script>`
or `python -m <module>` in a process of its own forked from this one, which has imported torch,
Hydra and the other libraries the scripts use: the command is a real process (its own argv, working
directory, environment, exit code, signal handlers and exit functions) without the seconds a new
interpreter spends importing them (about 3 s of CPU each on 2 cores, most of a tiny command's).
Any other command runs through bash. test_readme runs each docs page's commands so.

    python tests/forked_commands.py '[["FOLDER", ["COMMAND", ...]], ...]'

runs each folder's shell commands in it, the folders in order; stops at the first command that fails.
Prints one JSON line per command run: {"command", "returncode", "stdout", "stderr"}.
"""

import atexit
import json
import os
import resource
import runpy
import shlex
import subprocess
import sys
import tempfile
import traceback

import hydra  # noqa: F401  (imported once, here, for every command forked from this process)
import numpy  # noqa: F401
import tiktoken  # noqa: F401
import torch._dynamo  # noqa: F401  (built models and optimizers import it, ~1 s)

PYTHON = ("python", "python3")


def needs_bash(command: str) -> bool:
    """Whether bash would do more with the command than split it into words: an operator, a
    redirection, an expansion or a pattern outside quotes (an expansion inside double quotes)."""
    quote, escaped = None, False
    for ch in command:
        if escaped:
            escaped = False
        elif quote == "'":
            quote = None if ch == "'" else quote
        elif ch == "\\":
            escaped = True
        elif ch in "$`" or (quote is None and ch in "|&;<>()*?[{~"):
            return True
        elif ch in "'\"":
            quote = None if quote == ch else quote or ch
    return False


def forkable(command: str) -> list[str] | None:
    """The words of `python script.py ...` or `python -m module ...` with no interpreter option of its
    own and nothing for bash to do; None for any other command."""
    argv = None if needs_bash(command) else shlex.split(command)
    if argv and len(argv) >= 2 and argv[0] in PYTHON and (argv[1] == "-m" or not argv[1].startswith("-")):
        return argv
    return None


def run_python(argv: list[str]) -> int:
    """In the forked child: `python <argv[1:]>` as the interpreter would run it; its exit code."""
    if argv[1] == "-m":
        sys.argv, sys.path[0] = ["-m", *argv[3:]], os.getcwd()  # (runpy puts the module's path first)
    else:
        script = os.path.abspath(argv[1])
        sys.argv, sys.path[0] = [script, *argv[2:]], os.path.dirname(os.path.realpath(script))
    try:
        if argv[1] == "-m":
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(sys.argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:  # noqa: BLE001  as the interpreter: the traceback, exit code 1
        traceback.print_exc()
        return 1


def forked(argv: list[str], cwd: str, out, err) -> int:
    """argv run in `cwd` in a child forked from this process, stdout and stderr into the files out and
    err, stdin empty; its exit code (negative: the signal that ended it)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.chdir(cwd)
            with open(os.devnull) as devnull:
                os.dup2(devnull.fileno(), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code = run_python(argv)
            atexit._run_exitfuncs()  # what the interpreter runs at its exit
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001,S110  a closed stream: nothing left to write
                    pass
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def run(command: str, cwd: str) -> dict:
    """The command's result, run in `cwd`: {"command", "returncode", "stdout", "stderr"}."""
    argv = forkable(command)
    if argv is None:
        result = subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True,
                                timeout=300, stdin=subprocess.DEVNULL)
        return {"command": command, "returncode": result.returncode, "stdout": result.stdout,
                "stderr": result.stderr}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = forked(argv, cwd, out, err)
        out.seek(0), err.seek(0)
        return {"command": command, "returncode": code, "stdout": out.read(), "stderr": err.read()}


def main() -> None:
    # A full-disk test lowers the suite's file-size limit for a moment: a process started meanwhile
    # inherits it (as `ulimit -f unlimited` in bash, raised back to the hard limit).
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.getrlimit(resource.RLIMIT_FSIZE)[1],) * 2)
    for cwd, commands in json.loads(sys.argv[1]):
        for command in commands:
            result = run(command, cwd)
            print(json.dumps(result), flush=True)  # (flushed: a child forked next holds no copy of it)
            if result["returncode"] != 0:
                return

if __name__ == "__main__":
    main()
