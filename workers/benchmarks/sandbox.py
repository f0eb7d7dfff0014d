"""Run untrusted, model-written Python in a separate, limited process (HumanEval's pass@1).

What it does, layer by layer (all on by default):

* a separate interpreter (``python -I -S -B``: no site-packages, no user env, no .pyc writes),
  in a fresh empty temp dir as cwd, with a stripped environment, in its own session so a timeout
  kills the whole process group (SIGKILL after ``timeout_s`` of wall time);
* kernel resource limits, set by the child's first lines before the program is even read:
  CPU seconds (``timeout_s`` + 1), address space (1 GiB), file size 0 (no byte can be written to
  any regular file: the kernel refuses with EFBIG), no core files, 64 open files;
* no network: the child runs in a new network namespace (``unshare --user --map-root-user --net``,
  else ``unshare --net`` where only root may unshare) where no interface is up; with a user
  namespace it also cannot raise its hard limits or rejoin the host's namespaces;
* a Python audit hook (PEP 578, cannot be removed once added) that refuses: opening any file for
  writing, deleting/renaming/chmod/mkdir/links, creating sockets, fork/exec/subprocess/os.system,
  signals to other processes, ctypes, gc object walking and changing rlimits.

What it does not guarantee: the audit hook is a Python-level guard, not a security boundary
(PEP 578 says so): a deliberately malicious program may find a way around it. The kernel layers
(rlimits, network namespace, process group kill) hold regardless, but without a mount namespace
or a separate user the process still has its parent's file permissions: truncating, deleting or
renaming files is stopped only by the hook (RLIMIT_FSIZE stops writing bytes, not ``O_TRUNC`` or
``unlink``). Where ``unshare`` is unavailable the network layer is skipped (``network`` in the
result says which one ran). For hostile code, run the worker in a container. Model outputs under
evaluation are buggy, not hostile, which is the case this is built for.

Pass/fail: the program passes only if it exits 0 *and* the harness afterwards prints a nonce the
program never saw in its text, so ``sys.exit(0)``/``os._exit(0)`` before the tests ran is a fail.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_BYTES = 1 << 30
_TAIL_BYTES = 64 << 10  # keep this much of each stream: a print loop must not fill our memory

# The child's first code. Runs with -I -S -B; argv: cpu_s, address_space, file_size, nofile, guard.
_PRELUDE = r'''
import os, sys, resource
def _limits():
    cpu, mem, fsize, nofile = (int(v) for v in sys.argv[1:5])
    for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                         (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, nofile)):
        if value < 0:
            continue
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
def _guard():
    write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    denied = frozenset("""os.remove os.rmdir os.rename os.truncate os.mkdir os.chmod os.chown os.utime os.link
        os.symlink os.chflags os.lchflags os.setxattr os.removexattr os.chroot shutil.rmtree shutil.move
        os.fork os.forkpty os.exec os.posix_spawn os.spawn os.system os.startfile subprocess.Popen pty.spawn
        os.kill os.killpg signal.pthread_kill socket.__new__ socket.connect socket.bind socket.getaddrinfo
        socket.gethostbyname socket.sendto socket.sendmsg ctypes.dlopen ctypes.dlsym ctypes.cdata
        ctypes.call_function ctypes.PyObj_FromPtr ctypes.addressof gc.get_objects gc.get_referrers
        gc.get_referents resource.setrlimit resource.prlimit""".split())
    denied_imports = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "subprocess", "multiprocessing",
                                "_multiprocessing", "cffi"))
    def hook(event, args):
        if event in denied:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and not isinstance(args[0], int):
            mode, flags = args[1] or "", args[2] or 0
            if any(c in mode for c in "wax+") or flags & write:
                raise PermissionError(f"sandbox: writing files is not allowed ({args[0]!r})")
        if event == "import" and args[0] in denied_imports:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
    sys.addaudithook(hook)
def _main():
    _limits()
    nonce = sys.stdin.readline().strip()
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    code = compile(source, "program.py", "exec")
    if sys.argv[5] == "1":
        _guard()
    sys.argv = ["program.py"]
    exec(code, {"__name__": "__sandbox__", "__file__": "program.py", "__builtins__": __builtins__})
    sys.stdout.flush()
    os.write(1, ("\n" + nonce + "\n").encode())
_main()
'''


@dataclass(frozen=True)
class SandboxResult:
    status: str  # "passed" | "failed" | "timeout"
    reason: str  # "passed", "AssertionError", "timeout after 10.0s", "exited early (code 0) ...", ...
    returncode: int
    stdout_tail: str
    stderr_tail: str
    wall_s: float
    network: str  # which network isolation ran: "netns-user", "netns", or "none"

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.cache
def network_wrapper() -> tuple[tuple[str, ...], str]:
    """The ``unshare`` prefix that works on this machine (probed once), and its label."""
    exe = shutil.which("unshare")
    if exe is None:
        return (), "none"
    for args, label in ((("--user", "--map-root-user", "--net"), "netns-user"), (("--net",), "netns")):
        cmd = (exe, *args, "--")
        try:
            ok = subprocess.run([*cmd, sys.executable, "-I", "-S", "-c", "pass"], capture_output=True,
                                timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return cmd, label
    return (), "none"


class _Tail(threading.Thread):
    """Drain a pipe, keeping only its last bytes."""

    def __init__(self, stream: IO[bytes]):
        super().__init__(daemon=True)
        self.stream, self.data, self._head = stream, bytearray(), bytearray()

    def run(self) -> None:
        while chunk := self.stream.read1(1 << 16):  # type: ignore[attr-defined]
            if len(self._head) < 4096:
                self._head += chunk[:4096 - len(self._head)]
            self.data += chunk
            if len(self.data) > 2 * _TAIL_BYTES:
                del self.data[:-_TAIL_BYTES]

    def text(self) -> str:
        return bytes(self.data[-_TAIL_BYTES:]).decode("utf-8", errors="replace")

    @property
    def head(self) -> str:
        """The stream's first 4 KiB (the tail may have dropped them)."""
        return bytes(self._head).decode("utf-8", errors="replace")


def _last_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def run_python(source: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES,
               file_size_bytes: int = 0, guard: bool = True, isolate_network: bool = True) -> SandboxResult:
    """Run ``source`` in a limited child process; never in this process.

    The program runs as module ``__sandbox__``, not ``__main__``: like the original HumanEval
    harness, ``if __name__ == "__main__":`` demo blocks in a completion do not run.

    ``guard=False`` / ``isolate_network=False`` switch off one layer each (for tests of the others).
    """
    wrapper, network = network_wrapper() if isolate_network else ((), "none")
    cpu_s = int(timeout_s) + 1  # CPU limit backs up the wall-clock timeout (e.g. if our thread stalls)
    cmd = [*wrapper, sys.executable, "-I", "-S", "-B", "-c", _PRELUDE,
           str(cpu_s), str(memory_bytes), str(file_size_bytes), "64", "1" if guard else "0"]
    workdir = tempfile.mkdtemp(prefix="spectune-sandbox-")
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
    nonce = secrets.token_hex(16)
    t0 = time.perf_counter()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        rc, timed_out, out, err = _run_child(cmd, workdir, env, nonce, timeout_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.perf_counter() - t0
    stdout, stderr = out.text(), err.text()
    if timed_out:
        status, reason = "timeout", f"timeout after {timeout_s:g}s"
    elif rc == -signal.SIGXCPU:
        status, reason = "timeout", f"CPU limit of {cpu_s}s exceeded"
    elif rc == 0 and stdout.rstrip().endswith(nonce):
        status, reason = "passed", "passed"
    elif rc == 0:
        status, reason = "failed", "exited early (code 0) before the tests finished"
    elif rc < 0:
        status, reason = "failed", f"killed by signal {signal.Signals(-rc).name}"
    else:
        status, reason = "failed", _last_error(stderr) or f"exit code {rc}"
    stdout = stdout.replace(nonce, "<nonce>")
    return SandboxResult(status, reason, rc, stdout, stderr, round(wall, 3), network)


def _run_child(cmd: list[str], workdir: str, env: dict[str, str], nonce: str, timeout_s: float
               ) -> tuple[int, bool, _Tail, _Tail]:
    """Start ``cmd`` in its own session, hand it the nonce on stdin, keep the tails of its streams, and SIGKILL its
    process group after ``timeout_s`` of wall time: (exit status, timed out, stdout tail, stderr tail). Both
    sandbox profiles run their child through this."""
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
    out, err = _Tail(proc.stdout), _Tail(proc.stderr)  # type: ignore[arg-type]
    out.start()
    err.start()
    try:
        proc.stdin.write((nonce + "\n").encode())  # type: ignore[union-attr]
        proc.stdin.close()  # type: ignore[union-attr]
    except BrokenPipeError:
        pass  # the child died before reading: its exit status tells why
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):  # it may exit between the timeout and the kill
            # not yet reaped, so the group id is still ours (the data profile's unshare --kill-child takes its
            # PID namespace with it)
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    out.join(5)
    err.join(5)
    return rc, timed_out, out, err
