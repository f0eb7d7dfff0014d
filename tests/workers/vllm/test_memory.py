"""Memory sizing from the models' configs: parameter counts, the per-device plan and the docs' table."""

from __future__ import annotations

import pytest
import torch

from workers.models.tiny import save_tiny_pair, tiny_random_pair
from workers.vllm.common import memory_shares
from workers.vllm.memory import GIB, QWEN25, ModelShape, main, plan_memory, table
from workers.vllm.settings import VLLMSettings


@pytest.mark.parametrize(("name", "published"), [("0.5B", 0.49e9), ("1.5B", 1.54e9), ("7B", 7.61e9), ("72B", 72.7e9)])
def test_parameter_counts_match_the_published_ones(name, published):
    assert ModelShape(**QWEN25[name]).params == pytest.approx(published, rel=0.02)


def test_a_saved_pair_counts_exactly_what_torch_holds(tmp_path):
    draft_dir, target_dir = save_tiny_pair(tmp_path, draft_vocab=288)
    pair = tiny_random_pair(torch.float32, head_dim=64, draft_vocab=288)
    for model, path in ((pair.draft, draft_dir), (pair.target, target_dir)):
        assert ModelShape.from_dir(path).params == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="no readable config.json"):
        ModelShape.from_dir(tmp_path)


@pytest.mark.parametrize("draft_ids", [None, list(range(0, 320, 2))])
def test_an_eagle3_head_counts_what_its_checkpoint_holds(tmp_path, draft_ids):
    """An EAGLE-3 head: one layer reading 2 x hidden, fc over three target states, an LM head over its own
    vocabulary, no embedding of its own (vLLM shares the target's); vLLM's layout and the speculators one."""
    import json

    from safetensors.torch import load_file

    from workers.models.eagle import save_tiny_eagle3_head

    _, target = save_tiny_pair(tmp_path / "pair")
    head = save_tiny_eagle3_head(tmp_path / "head", target, draft_ids=draft_ids)
    held = sum(t.numel() for name, t in load_file(str(head / "model.safetensors")).items()
               if name not in ("d2t", "t2d"))  # the vocabulary maps are buffers, not weights
    shape = ModelShape.from_dir(head)
    assert not shape.embedding and shape.aux_layers == 3 and shape.layers == 1
    assert shape.params == held and shape.head_vocab == (0 if draft_ids is None else 160)
    assert shape.params < ModelShape.from_dir(target).params
    cfg = json.loads((head / "config.json").read_text())
    layer = {k: cfg.pop(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim")}
    nested = {**cfg, "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer}
    assert ModelShape.from_config(nested).params == held + shape.vocab * shape.hidden  # its embedding: unknown, counted


def test_a_7b_reference_gets_what_its_weights_need_where_the_fixed_split_starved_it():
    target, draft = ModelShape(**QWEN25["7B"]), ModelShape(**QWEN25["0.5B"])
    weights = target.weight_bytes(2)
    _, fixed_ref = memory_shares(VLLMSettings(), shared=True)  # the fixed 0.85 x 0.35 split
    assert fixed_ref * 40 * GIB < weights, "the old split could not even load the 7B reference on 40 GB"
    plan = plan_memory(40 * GIB, target, draft)
    assert plan.mode == "one at a time" and plan.reference_utilization * 40 * GIB >= plan.reference_gib * GIB
    big = plan_memory(80 * GIB, target, draft)
    assert big.mode == "both"
    assert big.speculative_utilization * 80 >= big.speculative_gib and big.reference_utilization * 80 >= big.reference_gib
    assert (big.speculative_utilization + big.reference_utilization) * 80 <= 80 - big.headroom_gib + 0.1


def test_tensor_parallelism_must_split_both_models_heads():
    small = ModelShape(**QWEN25["0.5B"])  # 14 heads, 2 KV heads
    assert [t for t in (1, 2, 4, 7, 8, 14) if small.splits_over(t)] == [1, 2, 14]
    plan = plan_memory(24 * GIB, ModelShape(**QWEN25["7B"]), small)
    assert plan.mode == "does not fit" and plan.smallest_tp == 2 and "use TP 2" in plan.note
    never = plan_memory(24 * GIB, ModelShape(**QWEN25["72B"]), small)
    assert never.smallest_tp is None and "another draft" in never.note
    with pytest.raises(ValueError, match="unknown dtype"):
        plan_memory(24 * GIB, small, small, dtype="int3")


def test_the_table_covers_every_card_and_target_and_the_cli_reads_dirs(tmp_path, capsys):
    text = table()
    assert text.count("\n") == 1 + 4 * 3 and "| 80 GB | 1.5B → 72B | 4 |" in text
    draft_dir, target_dir = save_tiny_pair(tmp_path)
    assert main(["--target", str(target_dir), "--draft", str(draft_dir), "--card-gib", "24"]) == 0
    assert '"mode": "both"' in capsys.readouterr().out


def test_the_rules_working_memory_is_one_chunk_of_dropmatch_logits_at_most():
    """rule_working_bytes (the plan's reservation for a rule's run-time memory, held against the device's
    peak by jobs.gpu_check): K x rows x V float32, capped at one chunk per head; the plan's extras hold it."""
    from policies.ragged import CHUNK_ELEMENTS
    from workers.vllm.memory import PLAN_DROPMATCH_K, rule_working_bytes

    assert rule_working_bytes(1000, 10, 4) == 4 * 10 * 1000 * 4
    assert rule_working_bytes(152_064, 256 * 5, 8) == 8 * CHUNK_ELEMENTS * 4  # 1,280 rows x V > one chunk
    small, big = ModelShape(**QWEN25["0.5B"]), ModelShape(**QWEN25["7B"])
    plan = plan_memory(141 * GIB, big, small, max_num_seqs=256, draft_len=5)
    q_cache = 2 * 256 * 5 * big.vocab * 2
    assert plan.extras_gib == round((q_cache + rule_working_bytes(big.vocab, 256 * 5, PLAN_DROPMATCH_K)) / GIB, 2)
