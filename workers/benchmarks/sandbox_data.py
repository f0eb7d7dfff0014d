"""The data-stack sandbox profile: run model-written pandas/matplotlib code (DataFrameBench's pass@1).

HumanEval's profile (``workers.benchmarks.sandbox``) runs ``python -I -S`` with no site-packages
and refuses ctypes and every file write, so it cannot import pandas. This profile runs the
program in a separate environment, ``.sandbox-venv`` (pandas, numpy, matplotlib, seaborn, scipy,
scikit-learn, pytz, pinned by ``constraints/sandbox.txt``, made by ``scripts/setup-sandbox-env``), and
holds it with limits that bind when the caller is root (CI runs as root, and RLIMIT_NPROC does
not bind root):

* **an unprivileged uid** (``nobody``, 65534, unless ``SPECTUNE_SANDBOX_UID``): the child drops to
  it (``setpriv --reuid --regid --clear-groups``) before the interpreter starts, so RLIMIT_NPROC
  binds (a fork bomb stops at ``max_procs`` processes of that uid) and file permissions confine
  writes: the uid owns only the per-run scratch directory (its cwd, ``HOME``, ``TMPDIR``,
  ``MPLCONFIGDIR``); the repository, the venv and the caller's files are not writable to it;
* **a PID namespace** (``unshare --pid --fork --kill-child``): when the run ends or times out the
  namespace's init is killed and the kernel kills every process left in it, setsid or not;
* **no network**: a new network namespace (``unshare --net``) with no interface up;
* kernel resource limits, set by the child's first lines: address space (``memory_bytes``,
  default 2 GiB), CPU seconds (``timeout_s`` + 1), processes (``max_procs``), file size (64 MiB:
  bounds what may be written in world-writable places such as /tmp), no core files;
* a wall-clock timeout that kills the whole process group and the PID namespace;
* a Python audit hook (a guard, not a boundary) refusing writes outside the scratch directory
  (which catches world-writable places the uid could write: /tmp, /dev/shm), sockets,
  subprocesses, fork/exec and rlimit changes. ctypes is allowed: numpy imports it.

The uid layers need root (or CAP_SETUID); without root the profile still runs, with
RLIMIT_NPROC binding the caller's own uid instead, and ``isolation`` in the result says what ran.
The venv and its base interpreter must be readable by the sandbox uid: the set-up script builds
the venv from the system interpreter (/usr/bin/python3.11) when the project's interpreter lives
under a private home (pyenv in /root); a venv the uid cannot start is a sandbox start failure.

A run that could not start (no venv, an interpreter the uid cannot read, unshare refused) has
status ``"error"``: a harness error, never a model failure (see ``DataFrameBench.score``).
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from workers.benchmarks.sandbox import SandboxResult, _last_error, _run_child

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_VENV = Path("/var/tmp/spectune-sandbox-venv")  # where the checkout is not reachable by others (under /root)


def others_can_reach(path: Path) -> bool:
    """Can a user who is neither owner nor group (the sandbox's ``nobody``) walk down to ``path``? Every directory
    on the way needs its others-execute bit."""
    path = path.resolve()
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in (path, *path.parents) if p.exists())


# the sandbox venv's default place: in the checkout where the sandbox uid can reach it, else a shared folder
# (scripts/setup-sandbox-env makes the same choice)
DEFAULT_VENV = REPO_ROOT / ".sandbox-venv" if others_can_reach(REPO_ROOT) else SHARED_VENV
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MEMORY_BYTES = 2 << 30
DEFAULT_MAX_PROCS = 64  # threads count too; BLAS and OpenMP are pinned to one thread
DEFAULT_FILE_SIZE = 64 << 20
SANDBOX_UID = 65534
SETUP_COMMAND = "bash scripts/setup-sandbox-env"

# The child's first code, run by the sandbox venv's interpreter with -I -B.
# argv: cpu_s, address_space, nproc, file_size, guard, scratch dir.
_PRELUDE = r'''
import os, sys, resource
def _limits():
    cpu, mem, nproc, fsize = (int(v) for v in sys.argv[1:5])
    for which, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc),
                         (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0)):
        if value < 0:
            continue
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
def _guard(scratch):
    write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    denied = frozenset("""os.fork os.forkpty os.exec os.posix_spawn os.spawn os.system subprocess.Popen pty.spawn
        os.kill os.killpg signal.pthread_kill socket.__new__ socket.connect socket.bind socket.getaddrinfo
        socket.gethostbyname socket.sendto socket.sendmsg resource.setrlimit resource.prlimit os.chroot""".split())
    paths = frozenset("""os.remove os.rmdir os.rename os.truncate os.mkdir os.chmod os.chown os.utime os.link
        os.symlink shutil.rmtree shutil.move shutil.copyfile""".split())
    dest_only, both = frozenset(("os.symlink", "os.link", "shutil.copyfile")), frozenset(("os.rename", "shutil.move"))
    def inside(p):
        if isinstance(p, int):
            return True
        try:
            real = os.path.realpath(os.fsdecode(p))
        except (TypeError, ValueError):
            return False
        return real == scratch or real.startswith(scratch + os.sep) or real == os.devnull
    def hook(event, args):
        if event in denied:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args[0] is not None and not isinstance(args[0], int):
            mode, flags = args[1] or "", args[2] or 0
            if (any(c in mode for c in "wax+") or flags & write) and not inside(args[0]):
                raise PermissionError(f"sandbox: writing outside the scratch directory is not allowed ({args[0]!r})")
        elif event in paths:
            # what the event changes: the destination of a copy or link, both ends of a rename, else the path
            changed = args[1:2] if event in dest_only else args[:2] if event in both else args[:1]
            if not all(inside(a) for a in changed if isinstance(a, (str, bytes, os.PathLike))):
                raise PermissionError(f"sandbox: {event} outside the scratch directory is not allowed")
    sys.addaudithook(hook)
def _main():
    _limits()
    scratch = os.path.realpath(sys.argv[6])
    nonce = sys.stdin.readline().strip()
    os.write(2, b"[sandbox started]\n")
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    code = compile(source, "program.py", "exec")
    if sys.argv[5] == "1":
        _guard(scratch)
    sys.argv = ["program.py"]
    # a real module, so tests can patch(__name__ + ".choice") and pickle what the program defines
    module = type(sys)("__sandbox__")
    module.__file__ = "program.py"
    sys.modules["__sandbox__"] = module
    exec(code, module.__dict__)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, ("\n" + nonce + "\n").encode())
_main()
'''
_STARTED = "[sandbox started]"


def venv_python(venv: str | os.PathLike[str] | None = None) -> Path:
    """The sandbox venv's interpreter (``$SPECTUNE_SANDBOX_VENV``, else ``<repo>/.sandbox-venv``, else, where the
    sandbox uid cannot reach the checkout, ``/var/tmp/spectune-sandbox-venv``)."""
    root = Path(venv or os.environ.get("SPECTUNE_SANDBOX_VENV") or DEFAULT_VENV)
    return root / "bin" / "python"


def sandbox_uid() -> int | None:
    """The uid the child drops to: only when we are root (else there is nothing to drop)."""
    if os.geteuid() != 0:
        return None
    return int(os.environ.get("SPECTUNE_SANDBOX_UID", SANDBOX_UID))


@functools.cache
def _wrappers(uid: int | None) -> tuple[tuple[str, ...], str]:
    """The command prefix (namespaces, then the uid drop) that works here, probed once, and its label."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    drop: tuple[str, ...] = ()
    label = []
    if uid is not None and setpriv:
        drop = (setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--")
        label.append(f"uid={uid}")
    candidates: list[tuple[tuple[str, ...], str]] = []
    if unshare:
        if os.geteuid() == 0:
            candidates.append(((unshare, "--net", "--pid", "--fork", "--kill-child", "--"), "netns+pidns"))
        candidates.append(((unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--"),
                           "userns+netns+pidns"))
        candidates.append(((unshare, "--user", "--map-root-user", "--net", "--"), "userns+netns"))
    for prefix, name in candidates:
        try:
            ok = subprocess.run([*prefix, *drop, "/bin/true"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return (*prefix, *drop), "+".join([name, *label])
    return drop, "+".join(["no-namespaces", *label])


def run_data_python(source: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                    max_procs: int = DEFAULT_MAX_PROCS, file_size_bytes: int = DEFAULT_FILE_SIZE, guard: bool = True,
                    venv: str | os.PathLike[str] | None = None, files: dict[str, bytes] | None = None
                    ) -> SandboxResult:
    """Run ``source`` in the data-stack sandbox; never in this process.

    Status: ``"passed"``, ``"failed"``, ``"timeout"``, or ``"error"`` when the sandbox itself did not
    start (a harness error). ``network`` in the result holds the isolation that ran (namespaces, uid).
    ``files`` are put into the scratch directory beside ``program.py`` before the run.
    """
    python = venv_python(venv)
    uid = sandbox_uid()
    wrapper, isolation = _wrappers(uid)
    if not python.exists():
        return SandboxResult("error", f"sandbox venv missing: {python} (run `{SETUP_COMMAND}`)", -1, "", "", 0.0,
                             isolation)
    cpu_s = int(timeout_s) + 1
    workdir = tempfile.mkdtemp(prefix="spectune-datasandbox-")
    cmd = [*wrapper, str(python), "-I", "-B", "-c", _PRELUDE, str(cpu_s), str(memory_bytes), str(max_procs),
           str(file_size_bytes), "1" if guard else "0", workdir]
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
           "MPLCONFIGDIR": workdir, "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0", **threads}
    nonce = secrets.token_hex(16)
    t0 = time.perf_counter()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        for name, data in (files or {}).items():
            Path(workdir, name).write_bytes(data)
        if uid is not None:
            for dirpath, _dirs, names in os.walk(workdir):
                for p in (dirpath, *(os.path.join(dirpath, n) for n in names)):
                    os.chown(p, uid, uid)
        rc, timed_out, out, err = _run_child(cmd, workdir, env, nonce, timeout_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.perf_counter() - t0
    stdout, stderr = out.text(), err.text()
    started = _STARTED in err.head
    if timed_out:
        status, reason = "timeout", f"timeout after {timeout_s:g}s"
    elif rc == -signal.SIGXCPU or rc == 128 + signal.SIGXCPU:
        status, reason = "timeout", f"CPU limit of {cpu_s}s exceeded"
    elif rc == 0 and stdout.rstrip().endswith(nonce):
        status, reason = "passed", "passed"
    elif not started:
        status, reason = "error", f"sandbox did not start: {_last_error(stderr) or f'exit code {rc}'}"
    elif rc == 0:
        status, reason = "failed", "exited early (code 0) before the tests finished"
    elif rc < 0:
        status, reason = "failed", f"killed by signal {signal.Signals(-rc).name}"
    else:
        status, reason = "failed", _last_error(stderr) or f"exit code {rc}"
    stdout = stdout.replace(nonce, "<nonce>")
    return SandboxResult(status, reason, rc, stdout, stderr, round(wall, 3), isolation)
