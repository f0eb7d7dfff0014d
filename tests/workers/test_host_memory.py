"""workers.host_memory: a verify step's freed full-vocabulary temporaries stay in the process, where glibc's
default thresholds fault them in afresh on every pass."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from workers.host_memory import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory(), "applied once, then reported again"
from jobs.gpu.steps import call_rule, synthetic_step
from policies import make_policy
step = synthetic_step(16, 151_936, 64, torch.device("cpu"), draft_len=5, head_dtype=torch.float32)
rule = make_policy("kl_judge")
call_rule(rule, step, 0.7, per_request=True)  # warm-up: the heap grows to the step's working set once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    call_rule(rule, step, 0.7, per_request=True)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_verify_step_faults_no_pages_in_where_glibcs_default_faults_its_temporaries_in_again():
    faults = {mode: int(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                                       check=True).stdout.split()[-1]) for mode in ("keep", "default")}
    # two B = 16 steps at V 152k, KL judge at T = 0.7: ~10^5 faults by default, 0 to ~10^3 kept (the heap's
    # first growth past the warm-up's peak, which varies from run to run)
    assert faults["default"] > 20_000 and faults["default"] > 20 * faults["keep"], faults
