"""The data-stack sandbox profile (DataFrameBench): pandas runs, and each limit holds, as root too.

Where a layer can be switched off (``guard=False`` leaves the kernel layers: uid, namespaces,
rlimits), the kernel's part is tested alone, so the Python hook does not hide a kernel gap.
The venv is made by ``scripts/setup-sandbox-env`` (idempotent; a no-op once made).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from workers.benchmarks.sandbox_data import REPO_ROOT, SANDBOX_UID, _wrappers, run_data_python, sandbox_uid


@pytest.fixture(scope="module", autouse=True)
def sandbox_venv():
    subprocess.run(["bash", str(REPO_ROOT / "scripts" / "setup-sandbox-env")], check=True, timeout=1200)


def _procs_of(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += 1
            except FileNotFoundError:
                pass
    return n


def test_pandas_matplotlib_and_scratch_writes_work():
    res = run_data_python("import pandas as pd, matplotlib.pyplot as plt, seaborn as sns\n"
                          "df = pd.DataFrame({'a': [1, 2]})\ndf.to_csv('out.csv')\n"
                          "ax = sns.histplot(df['a']); plt.savefig('fig.png')\n"
                          "assert pd.read_csv('out.csv')['a'].sum() == 3\n")
    assert res.passed, res


def test_runs_as_an_unprivileged_uid_when_root():
    if os.geteuid() != 0:
        pytest.skip("the uid drop is for root callers")
    res = run_data_python(f"import os\nassert os.getuid() == os.getgid() == {SANDBOX_UID}, os.getuid()\n")
    assert res.passed and f"uid={SANDBOX_UID}" in res.network, res


def test_infinite_loop_is_killed_by_the_timeout():
    res = run_data_python("while True:\n    pass\n", timeout_s=2.0)
    assert res.status == "timeout" and res.wall_s < 6, res


def test_allocation_over_the_memory_limit_fails():
    res = run_data_python("x = bytearray(600 << 20)\n", memory_bytes=512 << 20, guard=False)
    assert res.status == "failed" and "MemoryError" in res.reason, res


def test_network_connect_fails_without_the_guard():
    res = run_data_python("import socket\ns = socket.socket()\ns.settimeout(3)\ns.connect(('1.1.1.1', 80))\n",
                          guard=False, timeout_s=20)
    assert res.status == "failed" and ("unreachable" in res.reason or "Errno" in res.reason), res
    assert "netns" in res.network


def test_fork_bomb_is_contained_and_returns_promptly():
    bomb = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    uid = sandbox_uid()
    before = _procs_of(uid) if uid is not None else 0
    t0 = time.perf_counter()
    res = run_data_python(bomb, guard=False, timeout_s=4.0, max_procs=32)
    assert res.status in ("timeout", "failed") and time.perf_counter() - t0 < 20, res
    if uid is not None and "pidns" in res.network:
        deadline = time.monotonic() + 5  # the PID namespace's init is gone: the kernel reaps the rest
        while _procs_of(uid) > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _procs_of(uid) <= before


def test_fork_is_refused_by_the_guard():
    res = run_data_python("import os\nos.fork()\n")
    assert res.status == "failed" and "os.fork is not allowed" in res.reason, res


def test_writes_outside_scratch_are_refused(tmp_path):
    target = tmp_path / "outside.txt"  # root-owned, not world-writable: the uid's permissions refuse it
    res = run_data_python(f"open({str(target)!r}, 'w').write('x')\n", guard=False)
    if sandbox_uid() is not None:
        assert res.status == "failed" and "Permission denied" in res.reason, res
    res = run_data_python(f"open({str(target)!r}, 'w').write('x')\n")  # the guard refuses it for any caller
    assert res.status == "failed" and "outside the scratch directory" in res.reason, res
    res = run_data_python("import os\nos.remove('/tmp/anything')\n")
    assert res.status == "failed" and "not allowed" in res.reason, res
    assert not target.exists()


def test_file_size_is_capped():
    res = run_data_python("open('big', 'wb').write(b'x' * (8 << 20))\n", file_size_bytes=1 << 20)
    assert res.status == "failed", res


def test_a_missing_venv_is_a_start_error_not_a_failure(tmp_path):
    res = run_data_python("pass\n", venv=tmp_path / "nope")
    assert res.status == "error" and "sandbox venv missing" in res.reason, res


def test_an_interpreter_that_cannot_start_is_a_start_error(tmp_path):
    broken = tmp_path / "venv" / "bin"
    broken.mkdir(parents=True)
    (broken / "python").write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 3\n")
    (broken / "python").chmod(0o755)
    os.chmod(tmp_path, 0o755)
    res = run_data_python("pass\n", venv=tmp_path / "venv")
    assert res.status == "error" and res.reason.startswith("sandbox did not start"), res


def test_the_isolation_probe_names_its_layers():
    _prefix, label = _wrappers(sandbox_uid())
    if os.geteuid() == 0:
        assert "netns" in label and "pidns" in label and "uid=" in label, label


def test_copying_a_readable_file_into_scratch_is_allowed():
    res = run_data_python("import shutil, os\nshutil.copyfile(os.__file__, 'os_copy.py')\n"
                          "assert os.path.getsize('os_copy.py') > 0\n")
    assert res.passed, res
    res = run_data_python("import shutil, os\nshutil.copyfile('program.py', '/tmp/spectune-escape.py')\n")
    assert res.status == "failed" and "not allowed" in res.reason, res


def test_the_program_is_an_importable_module_so_tests_can_patch_it():
    res = run_data_python("import random\nfrom unittest.mock import patch\nfrom random import choice\n"
                          "def f():\n    return choice([1, 2])\n"
                          "with patch(__name__ + '.choice', return_value=7):\n    assert f() == 7\n"
                          "if __name__ == '__main__':\n    raise SystemExit('demo blocks do not run')\n")
    assert res.passed, res
