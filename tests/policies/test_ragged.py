"""verify_flat (vLLM's flat, ragged verify layout) against the padded reference, for every rule."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from policies import POLICIES, get_spec, make_policy
from policies.emission import leading_run
from policies.ragged import ragged_index, verify_flat
from tests.policies.batches import make_batch, reseeded

RULES = sorted(POLICIES)
NUM_DRAFT = [5, 2, 0, 3]  # one request drafted nothing this step; one drafted the full L
BONUS = torch.tensor([7, 8, 9, 10])


def example(name: str):
    return make_policy(name, **get_spec(name).example)


def flatten(batch, num_draft):
    """The rows vLLM would hand over: request-major, only each request's first n_i positions."""
    keep = [(b, j) for b, n in enumerate(num_draft) for j in range(n)]
    rows = torch.tensor([b for b, _ in keep]), torch.tensor([j for _, j in keep])
    return dict(
        draft_token_ids=batch.draft_token_ids[rows],
        num_draft_tokens=torch.tensor(num_draft),
        target_logits=batch.target_logits[rows],
        draft_logits=None if batch.draft_logits is None else batch.draft_logits[rows],
        target_hidden=None if batch.target_hidden is None else batch.target_hidden[rows],
        lm_head_weight=batch.lm_head_weight,
        lm_head_bias=batch.lm_head_bias,
        temperature=batch.temperature,
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", RULES)
def test_flat_decisions_equal_padded_reference(name, temperature):
    full = make_batch(temperature=temperature, batch_size=4, draft_len=5)
    policy = example(name)
    got = verify_flat(policy, bonus_token_ids=BONUS, generator=torch.Generator().manual_seed(1234),
                      **flatten(full, NUM_DRAFT))
    # Same shape [B, L] and generator state as the padded batch: the rule draws the same randomness,
    # so its decisions on the real positions must be identical and padding must never count (a look-ahead
    # rule, FLy, is told which positions are padding: it may not count them as accepted).
    _, valid = ragged_index(torch.tensor(NUM_DRAFT), 5)
    want = policy.decide(replace(reseeded(full, 1234), draft_valid=valid)).accepted & valid
    assert torch.equal(got.accepted, want)
    assert got.num_accepted.tolist() == leading_run(want).tolist()
    out = got.output_token_ids
    assert out.shape == (4, 6)
    for b, n in enumerate(NUM_DRAFT):
        k = int(got.num_accepted[b])
        assert k <= n
        assert out[b, :k].tolist() == full.draft_token_ids[b, :k].tolist(), "accepted drafts copied verbatim"
        if k == n:
            assert int(out[b, k]) == int(BONUS[b]), "all drafts accepted: the caller's bonus token"
        elif temperature == 0.0:
            assert int(out[b, k]) == int(full.target_logits[b, k].argmax()), "greedy recovery = target argmax"
        else:
            assert 0 <= int(out[b, k]) < full.vocab_size
        assert (out[b, k + 1:] == -1).all()


def _deterministic_at_t0(name: str) -> bool:
    batch, policy = make_batch(temperature=0.0, seed=3), example(name)
    a = policy.decide(reseeded(batch, 1)).accepted
    return all(torch.equal(a, policy.decide(reseeded(batch, s)).accepted) for s in (2, 3))


# Rules that draw randomness at T = 0 (DropMatch's dropout masks) decide per batch shape; the padded
# test above covers them. The rest must not care how requests are grouped.
DETERMINISTIC = [n for n in RULES if _deterministic_at_t0(n)]


def test_the_random_rules_are_the_dropout_ones():
    assert "lossless" in DETERMINISTIC and "kl_judge" in DETERMINISTIC and "dropmatch" not in DETERMINISTIC


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_chunking_and_per_request_agree(name):
    """Chunked by requests, or one request at a time: a deterministic rule decides the same."""
    full = make_batch(temperature=0.0, batch_size=4, draft_len=5, seed=3)
    policy = example(name)
    flat = flatten(full, NUM_DRAFT)
    whole = verify_flat(policy, bonus_token_ids=BONUS, **flat)
    chunked = verify_flat(policy, bonus_token_ids=BONUS, chunk_elements=1, **flat)
    assert torch.equal(whole.output_token_ids, chunked.output_token_ids)
    start = 0
    for b, n in enumerate(NUM_DRAFT):
        one = {k: (v[start:start + n] if isinstance(v, torch.Tensor) and k not in ("lm_head_weight", "lm_head_bias",
                                                                                   "num_draft_tokens") else v)
               for k, v in flat.items()}
        one["num_draft_tokens"] = torch.tensor([n])
        alone = verify_flat(policy, bonus_token_ids=BONUS[b:b + 1], **one)
        assert alone.output_token_ids[0, :n + 1].tolist() == whole.output_token_ids[b, :n + 1].tolist()
        start += n


def test_no_drafts_emits_the_bonus_tokens():
    v = 16
    got = verify_flat(make_policy("lossless"), draft_token_ids=torch.zeros(0, dtype=torch.long),
                      num_draft_tokens=torch.zeros(3, dtype=torch.long), target_logits=torch.zeros(0, v),
                      bonus_token_ids=torch.tensor([1, 2, 3]))
    assert got.output_token_ids.tolist() == [[1], [2], [3]]


def test_mismatched_ragged_sizes_are_named():
    with pytest.raises(ValueError, match="ragged batch mismatch"):
        verify_flat(make_policy("lossless"), draft_token_ids=torch.zeros(4, dtype=torch.long),
                    num_draft_tokens=torch.tensor([2, 1]), target_logits=torch.zeros(4, 8),
                    bonus_token_ids=torch.tensor([0, 0]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", RULES)
def test_vllm_placeholder_drafts_are_never_accepted(name, temperature):
    """vLLM's scheduler placeholders (-1) reach the rejection sampler as draft ids (seen at batch 32 on the
    real pair: every rule raised "index -1 is out of bounds" and the step fell back to greedy). Every rule
    now rejects such a position — the request's accepted run stops there and the position gets the
    target's token — and leaves the other requests' decisions as they were."""
    batch = make_batch(temperature=temperature, seed=3, batch_size=len(NUM_DRAFT))
    flat = flatten(batch, NUM_DRAFT)
    policy = example(name)
    gen = torch.Generator().manual_seed(0)
    clean = verify_flat(policy, bonus_token_ids=BONUS, generator=gen, **flat)
    # request 0's 4th draft is a placeholder (and make the drafts before it the target's greedy choice)
    flat["draft_token_ids"] = flat["draft_token_ids"].clone()
    flat["draft_token_ids"][:3] = flat["target_logits"][:3].argmax(dim=-1)
    flat["draft_token_ids"][3] = -1
    got = verify_flat(policy, bonus_token_ids=BONUS, generator=torch.Generator().manual_seed(0), **flat)
    assert int(got.num_accepted[0]) <= 3 and not bool(got.accepted[0, 3])
    row = got.output_token_ids[0].tolist()
    k = int(got.num_accepted[0])
    assert all(0 <= t < flat["target_logits"].shape[1] for t in row[:k + 1]) and row[k + 1:] == [-1] * (5 - k)
    if temperature == 0.0 and not get_spec(name).lossy:
        assert k == 3 and row[3] == int(flat["target_logits"][3].argmax()), "the target's token at the placeholder"
    assert got.output_token_ids[1:].tolist() == clean.output_token_ids[1:].tolist() or temperature > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", RULES)
def test_full_drafts_take_views_and_decide_as_the_gathered_path(name, temperature):
    """Every request drafted L and the host's lengths say so: the draft rows and the target block are views
    of the flat rows (no copy), chunk by chunk; the decisions are the gathered path's, bit for bit."""
    full = make_batch(temperature=temperature, batch_size=4, draft_len=5, seed=11)
    flat = flatten(full, [5] * 4)
    policy = example(name)
    seed = 123
    kwargs = dict(bonus_token_ids=BONUS, chunk_elements=1, **flat)  # one request per chunk
    viewed = verify_flat(policy, lengths=[5] * 4, generator=torch.Generator().manual_seed(seed), **kwargs)
    gathered = verify_flat(policy, generator=torch.Generator().manual_seed(seed), **kwargs)
    assert torch.equal(viewed.output_token_ids, gathered.output_token_ids)
    assert torch.equal(viewed.accepted, gathered.accepted)


def test_the_target_block_has_contiguous_draft_positions():
    from policies.ragged import _target_block

    flat = torch.randn(12, 7)  # 4 requests x L 3
    index, _ = ragged_index(torch.tensor([3, 3, 3, 3]), 3)
    for first_row in (None, 3):
        block = _target_block(flat, index[1:3], first_row)  # requests 1 and 2
        assert block.shape == (2, 4, 7) and block[:, :-1].is_contiguous()
        assert torch.equal(block[:, :-1].reshape(6, 7), flat[3:9])
    assert _target_block(flat, index[1:3], 3).data_ptr() == flat[3].data_ptr(), "a view, not a copy"
    ragged, _ = ragged_index(torch.tensor([2, 0, 3]), 3)  # padding repeats a request's own last row
    block = _target_block(flat[:5], ragged, None)
    assert block[:, :-1].is_contiguous() and torch.equal(block[0, :2], flat[:2])
    assert torch.equal(block[2, :3], flat[2:5])


def chunk_sizes(monkeypatch, rule, fused_on: str, temperature: float) -> list[int]:
    """The requests per rule call of ``verify_flat`` over 12 requests (L 3, V 64), with CPU blocks of 2
    (eager), 6 (fused kernel) and 12 (DropMatch's candidate mode) requests."""
    import policies.ragged as ragged
    from policies import fused

    b, n, v = 12, 3, 64
    per_request = (n + 1) * v
    monkeypatch.setattr(ragged, "CHUNK_ELEMENTS_CPU", 2 * per_request)
    monkeypatch.setattr(ragged, "CHUNK_ELEMENTS_CPU_FUSED", 6 * per_request)
    monkeypatch.setattr(ragged, "CHUNK_ELEMENTS_CPU_HEADS", 12 * per_request)
    sizes: list[int] = []

    class Recording:
        def __init__(self) -> None:
            self.name, self.config = rule.name, rule.config

        def decide(self, batch):
            sizes.append(batch.batch_size)
            return rule.decide(batch)

    g = torch.Generator().manual_seed(0)
    with fused.forced(fused_on):
        verify_flat(Recording(), draft_token_ids=torch.randint(0, v, (b * n,), generator=g),
                    num_draft_tokens=torch.full((b,), n), target_logits=torch.randn(b * n, v, generator=g),
                    bonus_token_ids=torch.zeros(b, dtype=torch.long), draft_logits=torch.randn(b * n, v, generator=g),
                    target_hidden=torch.randn(b * n, 8, generator=g), lm_head_weight=torch.randn(v, 8, generator=g),
                    temperature=temperature, generator=torch.Generator().manual_seed(1))
    return sizes


@pytest.mark.parametrize("name, fused_on, sizes_seen", [("kl_judge", "1", [6, 6]), ("dropmatch", "1", [12]),
                                                        ("top_k", "1", [2] * 6), ("kl_judge", "0", [2] * 6),
                                                        ("dropmatch", "0", [2] * 6)])
def test_cpu_blocks_are_larger_only_for_rules_the_fused_kernel_serves(monkeypatch, name, fused_on, sizes_seen):
    """The fused kernel's readers (Traits.cpu_block) with the kernel on take CHUNK_ELEMENTS_CPU_FUSED blocks, DropMatch the larger
    CHUNK_ELEMENTS_CPU_HEADS (its per-chunk small ops: fewer chunks); every other rule (its eager passes prefer
    small blocks) and every rule with the kernel off take CHUNK_ELEMENTS_CPU."""
    rule = make_policy(name, **get_spec(name).example)
    assert chunk_sizes(monkeypatch, rule, fused_on, 0.7) == sizes_seen


@pytest.mark.parametrize("temperature, per_chunk", [(0.0, 3), (0.7, 1)])
def test_dropmatch_exact_mode_fits_its_k_heads_in_one_block(monkeypatch, temperature, per_chunk):
    """Exact mode holds K full-vocabulary head logits of a chunk (and their copy at T > 0): its chunks shrink by
    K (by 2K at T > 0) from the fused kernel's block, so the heads stay within one block (what the GPU memory
    plan reserves); only candidate mode takes the large CPU block."""
    rule = make_policy("dropmatch", mode="exact", k=2, criterion="naive")
    assert chunk_sizes(monkeypatch, rule, "1", temperature) == [per_chunk] * (12 // per_chunk)
