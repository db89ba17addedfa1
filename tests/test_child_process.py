"""The processes pyserve starts: the installed package whatever the working directory, and
secrets in the environment, never on the command line."""

from __future__ import annotations

import argparse
import subprocess
from importlib.metadata import version
from pathlib import Path

from pyserve.child_process import module_command, read_secrets, split_secrets


def decoy_package(folder: Path) -> Path:
    """A folder holding a `pyserve` package that fails on import, as a source tree without its
    compiled module would."""
    (folder / "pyserve").mkdir()
    (folder / "pyserve" / "__init__.py").write_text("raise ImportError('the decoy pyserve was imported')\n")
    (folder / "pyserve" / "cli.py").write_text("print('the decoy cli ran')\n")
    return folder


def test_a_child_imports_the_installed_package_beside_a_decoy(tmp_path):
    done = subprocess.run([*module_command("pyserve.cli"), "--version"], cwd=decoy_package(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, f"pyserve {version('pyserve')}"), done.stderr


def test_secret_flags_leave_the_command_line_for_the_environment():
    argv = ["serve", "m", "--api-key", "k1", "--max-num-seqs", "4", "--replica-api-key=k2", "--api-keys-file", "f"]
    assert split_secrets(argv) == (["serve", "m", "--max-num-seqs", "4", "--api-keys-file", "f"],
                                   {"PYSERVE_API_KEY": "k1", "PYSERVE_REPLICA_API_KEY": "k2"})


def test_a_secret_left_off_the_command_line_is_read_from_its_variable():
    args = argparse.Namespace(api_key=None, replica_api_key="given", port=1)
    read_secrets(args, {"PYSERVE_API_KEY": "from-env", "PYSERVE_REPLICA_API_KEY": "ignored"})
    assert (args.api_key, args.replica_api_key) == ("from-env", "given")  # the flag wins
    batch = argparse.Namespace(port=1)  # a command without the option gets none
    read_secrets(batch, {"PYSERVE_API_KEY": "from-env"})
    assert vars(batch) == {"port": 1}
