"""HumanEval execution: the canonical solutions pass, wrong code fails, and each sandbox layer holds.

Layers are tested one at a time where they can be switched off (``guard=False`` leaves only the
kernel limits and the network namespace), so a pass here is not one layer hiding another's bug.
"""

from __future__ import annotations

import socket
import threading

import pytest

from workers.benchmarks import get_benchmark
from workers.benchmarks.humaneval import build_program, extract_code
from workers.benchmarks.sandbox import network_wrapper, run_python


@pytest.fixture(scope="module")
def humaneval_items(bench_cache):
    return get_benchmark("humaneval").items(cache_dir=bench_cache)


def _fenced(code: str) -> str:
    return f"Here is the completed function:\n\n```python\n{code}```\n\nIt iterates over the list."


@pytest.mark.slow
def test_every_canonical_solution_passes(humaneval_items):
    bench = get_benchmark("humaneval")
    failed = []
    for item in humaneval_items:
        ref = item.reference
        score = bench.score(item, [_fenced(ref["prompt"] + ref["canonical_solution"])])
        if score.score != 1.0:
            failed.append((item.meta["task_id"], score.reason))
    assert not failed, f"the sandbox broke legitimate programs: {failed[:5]}"


def test_wrong_solution_fails_with_reason(humaneval_items):
    item = humaneval_items[0]
    wrong = f"def {item.meta['entry_point']}(numbers, threshold):\n    return False\n"
    s = get_benchmark("humaneval").score(item, [_fenced(wrong)])
    assert s.score == 0.0 and s.reason == "test failed: AssertionError" and s.details["mode"] == "redefinition"


def test_body_continuation_without_fence_passes(humaneval_items):
    item = humaneval_items[2]
    s = get_benchmark("humaneval").score(item, [item.reference["canonical_solution"]])
    assert s.score == 1.0 and s.details == s.details | {"extraction": "raw", "mode": "continuation"}


def test_empty_and_broken_replies_fail(humaneval_items):
    bench = get_benchmark("humaneval")
    assert bench.score(humaneval_items[0], ["   "]).reason == "no code found"
    s = bench.score(humaneval_items[0], [_fenced("def has_close_elements(:\n")])
    assert s.score == 0.0 and "SyntaxError" in s.reason


def test_extract_code_prefers_the_block_defining_the_entry_point():
    text = "```\npip install x\n```\nthen\n```python\ndef f(x):\n    return x\n```"
    assert extract_code(text, "f") == ("def f(x):\n    return x\n", "fenced")
    assert extract_code("```python\ndef f(x):\n    return 1", "f")[0] == "def f(x):\n    return 1"  # cut off
    assert extract_code("Sure! Here it is:\ndef f(x):\n    return 2\n", "f")[0].startswith("def f(x):")
    program, mode = build_program("def f(x):\n    '''doc'''\n", "def f(x):\n    return 3\n", "def check(c):\n    pass", "f")
    assert mode == "redefinition" and program.endswith("check(f)\n")


def test_infinite_loop_is_killed_by_the_timeout():
    res = run_python("while True:\n    pass\n", timeout_s=1.0)
    assert res.status == "timeout" and res.wall_s < 5, res


def test_humaneval_timeout_is_reported(humaneval_items):
    bench = type(get_benchmark("humaneval"))(timeout_s=1.0)
    s = bench.score(humaneval_items[0], [_fenced("def has_close_elements(numbers, threshold):\n    while True:\n        pass\n")])
    assert s.score == 0.0 and s.reason.startswith("timeout"), s


def test_early_exit_is_not_a_pass():
    for code in ("import sys\nsys.exit(0)\nassert False\n", "import os\nos._exit(0)\n"):
        res = run_python(code)
        assert res.status == "failed" and "exited early" in res.reason, res


def test_writing_outside_the_sandbox_fails_and_leaves_the_file(tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("original")
    for code in (f"open({str(target)!r}, 'w').write('pwned')", f"open({str(target)!r}, 'a').write('pwned')",
                 f"import os\nos.remove({str(target)!r})", f"import os\nos.truncate({str(target)!r}, 0)",
                 "open('here.txt', 'w').write('x')"):  # the guard refuses writes even inside its own dir
        res = run_python(code)
        assert res.status == "failed" and "sandbox" in res.reason, (code, res)
    assert target.read_text() == "original"


def test_file_size_limit_holds_without_the_python_guard(tmp_path):
    # Kernel layer alone: RLIMIT_FSIZE=0 refuses every byte (it cannot stop O_TRUNC, hence 'a' here).
    target = tmp_path / "outside.txt"
    target.write_text("original")
    res = run_python(f"with open({str(target)!r}, 'a') as f:\n    f.write('pwned')", guard=False)
    assert res.status == "failed" and "File too large" in res.reason, res
    # Without `with`, the error surfaces only when the file is garbage-collected, where Python
    # ignores it: the program "passes", but the kernel still kept every byte out.
    run_python(f"open({str(target)!r}, 'a').write('pwned')", guard=False)
    assert target.read_text() == "original"


@pytest.fixture()
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    threading.Thread(target=lambda: srv.accept(), daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def test_network_socket_fails(listener):
    res = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=2)")
    assert res.status == "failed" and "socket" in res.reason, res


def test_network_namespace_holds_without_the_python_guard(listener):
    _, label = network_wrapper()
    if label == "none":
        pytest.skip("unshare cannot create a network namespace here; only the Python guard blocks sockets")
    res = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=2)", guard=False)
    assert res.status == "failed" and res.network == label, res
    control = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=2)",
                         guard=False, isolate_network=False)
    assert control.passed, f"without both layers the connection should work, so the test means something: {control}"


def test_memory_limit_and_blocked_processes():
    assert "MemoryError" in run_python("x = bytearray(2 << 30)").reason
    for code in ("import subprocess", "import os\nos.fork()", "import os\nos.system('true')", "import ctypes"):
        res = run_python(code)
        assert res.status == "failed" and "sandbox" in res.reason, (code, res)


def test_environment_is_stripped_and_cwd_is_fresh(monkeypatch):
    monkeypatch.setenv("SPECTUNE_SECRET", "hunter2")
    res = run_python("import os\nassert 'SPECTUNE_SECRET' not in os.environ\nassert os.listdir('.') == ['program.py']")
    assert res.passed, res
