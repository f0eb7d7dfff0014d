"""What the vLLM engine's test modules share: the tiny pair's prompts and engine settings, the plugin's
traces (fixtures: tests/workers/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import torch

L = 4
PROMPTS = [[10, 20, 30, 40, 50], [72, 101, 108, 108, 111, 32], [257, 115, 121, 115, 10, 258, 10, 257]]
# An explicit KV size: on vLLM-CPU a memory fraction also has to cover the worker's own resident memory
# (~0.75 GiB), so a small fraction fails to start on a machine with less RAM.
# Both engines up at once (tiny models fit; the switching default on CPU is tested on its own).
SETTINGS = dict(draft_len=L, dtype="float32", kv_cache_memory_bytes=128 << 20, max_model_len=512, enforce_eager=True,
                one_engine_at_a_time=False)


def clear(trace_dir: Path) -> None:
    for f in trace_dir.glob("*.pt"):
        f.unlink()


def traces(trace_dir: Path) -> list[dict]:
    files = sorted(trace_dir.glob("*.pt"), key=lambda f: (int(f.name.split("-")[1]), f.name))
    return [torch.load(f, weights_only=False) for f in files]


def randomness(call: dict) -> dict:
    """Where a traced call drew its random numbers: per-request streams (a request's own rule: keyed by its
    seed) or one generator seeded for the step."""
    if call.get("row_keys") is not None:
        from policies.randomness import RowStreams

        return {"streams": RowStreams(torch.tensor(call["row_keys"], dtype=torch.int64))}
    return {"generator": torch.Generator().manual_seed(call["generator_seed"])}


def replay(policy, call: dict):
    """The plugin's flat path (policies.ragged.verify_flat) run again on a traced call's tensors."""
    from policies.ragged import verify_flat

    return verify_flat(
        policy, draft_token_ids=call["draft_token_ids"], num_draft_tokens=call["num_draft_tokens"],
        target_logits=call["target_logits"], bonus_token_ids=call["bonus_token_ids"],
        draft_logits=call["draft_logits"], target_hidden=call["target_hidden"],
        lm_head_weight=call["lm_head_weight"], lm_head_bias=call["lm_head_bias"],
        temperature=call["temperature"], draft_scaled=call["draft_scaled"], **randomness(call))
