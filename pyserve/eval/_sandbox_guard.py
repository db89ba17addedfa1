"""Run by code_sandbox as `python -I -B _sandbox_guard.py FOLDER SCRIPT MEMORY_BYTES CPU_SECONDS
FILE_BYTES`: sets the resource limits, installs the audit hook (see code_sandbox), then runs
SCRIPT as __main__."""

import os
import resource
import runpy
import sys


class SandboxRefused(PermissionError):
    pass


def main() -> None:
    folder, script = os.path.realpath(sys.argv[1]), sys.argv[2]
    memory, cpu, file_size = (int(v) for v in sys.argv[3:6])
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, file_size),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))

    def inside(path) -> bool:
        if isinstance(path, int):  # a file descriptor already open
            return True
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return real == folder or real.startswith(folder + os.sep)

    refused = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn",
               "os.spawn", "pty.spawn", "ctypes.dlopen", "ctypes.cdata", "os.kill", "os.killpg", "sys.addaudithook")
    writes = {"os.remove", "os.rmdir", "os.rename", "os.replace", "os.mkdir", "os.symlink", "os.link",
              "os.truncate", "os.chmod", "os.chown", "shutil.rmtree", "os.utime"}

    def hook(event: str, args: tuple) -> None:
        if event.startswith(refused):
            raise SandboxRefused(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode = args[0], args[1]
            writing = isinstance(mode, str) and any(c in mode for c in "wax+")
            if isinstance(mode, int):  # os.open flags
                writing = bool(mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            if writing and not inside(path):
                raise SandboxRefused(f"sandbox: writing {path!r} outside the sandbox folder is not allowed")
        elif event in writes:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise SandboxRefused(f"sandbox: {event} on {path!r} outside the sandbox folder is not allowed")

    sys.addaudithook(hook)
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")


main()
