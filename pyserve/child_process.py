"""How pyserve starts processes of its own (replicas, loopback servers, tensor-parallel ranks).

Two rules:
- A child runs the pyserve this process imported, whatever its working directory: `python -m`
  puts the working directory first on sys.path, where a source tree (with no compiled
  `pyserve._core`) or any folder named `pyserve` would shadow the installed package.
- Secrets never go on a child's command line, which any local user can read (`ps`); they go in
  its environment, which only its owner can. A flag left off the command line is read from its
  variable (`read_secrets`, called by the CLI), so a user may set the variable directly too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping

# flag -> the environment variable that carries its value
SECRET_FLAGS = {"--api-key": "PYSERVE_API_KEY", "--replica-api-key": "PYSERVE_REPLICA_API_KEY"}


def module_command(module: str) -> list[str]:
    """`python -m module` with the working directory kept off sys.path."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    # 3.10 has no -P: `-c` puts "" (the working directory) first on sys.path; drop it, then run.
    run = f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", f"import runpy, sys; sys.path.remove(''); {run}"]


def split_secrets(argv: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """`argv` without the secret flags (`--api-key KEY` or `--api-key=KEY`), and the environment
    variables that carry their values instead."""
    out: list[str] = []
    env: dict[str, str] = {}
    pending: str | None = None  # the variable whose value is the next argument
    for arg in argv:
        if pending is not None:
            env[pending], pending = arg, None
            continue
        name, eq, value = arg.partition("=")
        if name not in SECRET_FLAGS:
            out.append(arg)
        elif eq:
            env[SECRET_FLAGS[name]] = value
        else:
            pending = SECRET_FLAGS[name]
    return out, env


def read_secrets(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Each secret option of `args` not given on the command line takes its variable's value."""
    for flag, variable in SECRET_FLAGS.items():
        dest = flag.removeprefix("--").replace("-", "_")
        if hasattr(args, dest) and getattr(args, dest) is None and environ.get(variable):
            setattr(args, dest, environ[variable])
