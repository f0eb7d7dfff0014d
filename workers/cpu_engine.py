"""The speculative decoding engine on CPU (transformers models, eager PyTorch).

Knows two causal LMs over one vocabulary and an acceptance rule from ``policies``; knows nothing
about tokenization beyond decoding for stop strings, nothing about benchmarks or Ray.

Invariants (asserted every round — a cache that silently lags collapses acceptance):

- the target's KV cache holds every committed token but the last; a verify pass feeds
  ``[last, d_0 .. d_{L-1}]`` and returns L+1 logits rows and final hidden states from ONE
  forward (row i scores d_i, row L is the bonus slot); afterwards the cache is cropped to the
  committed tokens but the last;
- the draft's cache holds a prefix of the committed tokens; each round first feeds it every
  committed token it lacks (after a fully accepted round that is d_{L-1} and the bonus token),
  then proposes L tokens one forward at a time. Caches are cropped, never recomputed.

Prefix caching: each model's cache remembers the ids it holds; a new prompt keeps the longest
shared prefix (cropped) and prefills only the rest — a few-shot preamble or a system prompt is
computed once per engine, and the same prompt under another rule costs one token of prefill.

Only the logits rows that are used are computed: the LM head runs on the draft's last position
and never in prefill. Tensors are ``[1, ...]``: one sequence per engine. Several items at once run as rows of
the batched engine (``workers.cpu_batch``: each row a view of this engine with its own caches, its model calls
served together), each row's output identical to the same item decoded here alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from policies import Policy, VerifyBatch, make_policy, verify
from policies.coupling import CoupledNoise, check_sampler, perturbed_argmax
from policies.randomness import PositionStreams
from policies.registry import needs_draft_logits
from policies.truncation import check_truncation, truncate
from workers.models.fast import new_cache
from workers.models.pair import ModelPair
from workers.models.proposal import SIZE as PROPOSAL_SIZE
from workers.models.proposal import for_pair as proposal_for_pair
from workers.resets import resets_on_error
from workers.stats import Generation, GenerationStats

OnTokens = Callable[[list[int]], "bool | None"]


class _LM:
    """A causal LM split into decoder + LM head, with its own KV cache and the ids it holds."""

    def __init__(self, model: torch.nn.Module, width: int = 0, real: int = 0, batcher: Any = None,
                 rank: int = 1) -> None:
        """``width``: pad the head's logits with -inf up to this many ids (a draft narrower than
        its target). ``real``: set logits from this id on to -inf (the target of such a pair: those
        ids are no tokens and the draft cannot score them, so neither model may put mass there).
        ``batcher``: a row of the batched engine (``workers.cpu_batch``): model calls go through it;
        ``rank`` 0 for the draft, 1 for the target (the draft's calls of a step run first)."""
        self.model = model
        self.decoder = model.get_decoder()
        self._head = model.get_output_embeddings()
        self.width, self.real = width, real
        self.cache: Any = None
        self.ids: list[int] = []  # the token ids whose keys/values the cache holds, in order
        self.batcher, self.rank = batcher, rank
        if batcher is not None:
            from workers.cpu_batch import FORWARD, HEAD, forward_runner, row_exact_linear, rows_runner

            self._forward_key, self._forward_runner = (rank, FORWARD, 0), forward_runner(self.decoder)
            self._head_key = (rank, HEAD, 0)
            self._head_runner = rows_runner(self._head, row_exact_linear(self._head))

    def row(self, batcher: Any) -> _LM:
        """The same model with a cache of its own, its calls batched by ``batcher`` (a row of the batched engine)."""
        return _LM(self.model, self.width, self.real, batcher=batcher, rank=self.rank)

    def _batched(self) -> bool:
        return self.batcher is not None and self.batcher.active()

    def head(self, hidden: Tensor) -> Tensor:
        logits = self.batcher.call(self._head_key, self._head_runner, hidden) if self._batched() else self._head(hidden)
        if self.width > logits.shape[-1]:
            logits = torch.nn.functional.pad(logits, (0, self.width - logits.shape[-1]), value=float("-inf"))
        if self.real:
            logits[..., self.real:] = float("-inf")
        return logits

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.ids = []

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def forward(self, input_ids: Tensor) -> Tensor:
        """Feed tokens [B, n]; return final hidden states [B, n, d] (post final norm)."""
        if self._batched():
            hidden = self.batcher.call(self._forward_key, self._forward_runner, (self, input_ids))
        else:
            out = self.decoder(input_ids=input_ids, past_key_values=self.cache, use_cache=True)
            self.cache = out.past_key_values
            hidden = out.last_hidden_state
        self.ids += input_ids[0].tolist()
        return hidden

    def crop(self, length: int) -> None:
        if self.length > length:
            self.cache.crop(length - self.length)  # transformers 5: a negative count to remove
        del self.ids[length:]
        assert self.length == length == len(self.ids), f"KV cache holds {self.length} tokens, expected {length}"

    def reuse(self, context: list[int]) -> int:
        """Keep the cached prefix shared with ``context`` (prefix caching); return its length."""
        if self.cache is None:
            self.reset()
        n = 0
        for a, b in zip(self.ids, context, strict=False):
            if a != b:
                break
            n += 1
        self.crop(n)
        if self.batcher is not None and hasattr(self.cache, "copy_prefix"):
            found = self.batcher.donor(self, context, n)  # another row holds more of it: copy, do not recompute
            if found is not None:
                donor, n = found
                self.cache.copy_prefix(donor.cache, n)
                self.ids = donor.ids[:n]
                self.batcher.stats.prefix_copies += 1
                self.batcher.stats.prefix_tokens += n
        return n


@dataclass
class _Stop:
    eos: frozenset[int]
    strings: tuple[str, ...]
    max_new_tokens: int
    tokenizer: Any

    def cut(self, generated: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """Keep the prefix of ``new`` that may be emitted; say why generation ends, if it does."""
        room = self.max_new_tokens - len(generated)
        kept: list[int] = []
        for tok in new[:room]:
            if tok in self.eos:
                return kept, "eos"
            kept.append(tok)
            if self.strings and self._stop_string_in(generated + kept):
                return kept, "stop"
        if len(generated) + len(kept) >= self.max_new_tokens:
            return kept, "length"
        return kept, None

    def _stop_string_in(self, ids: list[int]) -> bool:
        # Decode only a short tail: stop strings are short and this runs per token.
        tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=False)
        return any(s in tail for s in self.strings)


def check_request(prompt_ids: Any, vocab_size: int, max_new_tokens: Any, temperature: Any) -> list[int]:
    """A generation request's shared checks (every engine): the prompt as a list of ids."""
    prompt = prompt_ids.flatten().tolist() if isinstance(prompt_ids, Tensor) else list(prompt_ids)
    if not prompt:
        raise ValueError("prompt_ids is empty: at least one token is needed")
    bad = [t for t in prompt if not (0 <= int(t) < vocab_size)]
    if bad:
        raise ValueError(f"prompt_ids has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (temperature >= 0.0):
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    return [int(t) for t in prompt]


class SpecDecoder:
    """Speculative decoding with any registered acceptance rule, plus target-only decoding."""

    def __init__(self, pair: ModelPair, prefix_cache: bool = True, proposal_size: int = PROPOSAL_SIZE) -> None:
        """``prefix_cache``: a new prompt reuses the KV entries of the longest prefix it shares
        with what each model's cache holds (a few-shot preamble, a system prompt, the same
        prompt under another rule) instead of recomputing them. Off, every prefill starts empty.
        ``proposal_size``: greedy drafting scores the tokenizer's first this-many ids and its special ids
        (``workers.models.proposal``; 0: the whole vocabulary)."""
        from policies import fused
        from workers.host_memory import keep_freed_memory
        from workers.models import fast_step

        fused.mode()  # a bad SPECTUNE_FUSED fails here, naming it, not once per step later
        fast_step.enabled()  # a bad SPECTUNE_SCRIPTED_STEP too
        keep_freed_memory()  # the verify step's full-vocabulary temporaries: heap, not fresh pages per pass
        self.pair = pair
        self.prefix_cache = prefix_cache
        # A narrower draft (pair.padded): its logits are padded with -inf to the target's width and
        # the target's logits past the draft's width are -inf too (also in target-only decoding and in
        # DropMatch's dropout heads, through the bias), so both distributions are zero on ids that are
        # no tokens: KL stays finite and lossless output equals target-only.
        real = pair.draft_width if pair.padded else 0
        self.target = _LM(pair.target, real=real)
        self.draft = _LM(pair.draft, width=pair.vocab_size, rank=0)
        self.batch_size: int | str = 1  # evaluate_items' rows at once (workers.cpu_batch); "auto": measured
        self._batcher: Any = None
        self.proposal = proposal_for_pair(pair, proposal_size)
        head = pair.target.get_output_embeddings()
        self.lm_head_weight = head.weight.detach()  # [V, d]
        self.lm_head_bias = None if head.bias is None else head.bias.detach()
        if real:
            bias = torch.zeros(pair.vocab_size, dtype=head.weight.dtype) if head.bias is None else head.bias.detach().clone()
            self.lm_head_bias = bias.index_fill_(0, torch.arange(real, pair.vocab_size), float("-inf"))

    # -- public API ------------------------------------------------------------------------------

    def row(self, batcher: Any) -> SpecDecoder:
        """A view of this engine for one row of the batched engine (``workers.cpu_batch``): the same models, rule
        code and proposal head, KV caches of its own, its model calls batched by ``batcher``."""
        import copy

        from workers.cpu_batch import BatchedProposal

        view = copy.copy(self)
        view.target, view.draft = self.target.row(batcher), self.draft.row(batcher)
        view.proposal = None if self.proposal is None else BatchedProposal(self.proposal, batcher)
        view._batcher = None
        return view

    def batcher(self, size: int | None = None, context: int = 512) -> Any:
        """The engine's :class:`workers.cpu_batch.Batcher` of ``size`` rows (default :attr:`batch_size`, ``auto``
        measured once, at ``context`` cached positions: the workload's), kept, so its rows' caches keep their
        prefixes from one call to the next."""
        from workers.cpu_batch import Batcher, pick_batch_size

        if size is None:
            if self.batch_size == "auto":
                self.batch_size, self.batch_choice = pick_batch_size(self, context=context)
            size = int(self.batch_size)
        if self._batcher is None or self._batcher.size != size:
            self._batcher = Batcher(self, size)
        return self._batcher

    def _context(self, bench: Any, items: list[Any], spec: Any) -> int:
        """The KV length ``items`` decode at (what ``auto`` times its batch sizes at); only worked out while
        ``auto`` is still to be measured."""
        if self.batch_size != "auto" or not items:
            return 512
        from workers.evaluation import items_context

        return items_context(self.pair, bench, items, spec)

    def evaluate_items(self, bench: Any, items: list[Any], spec: Any, references: dict[str, Any] | None = None,
                       *, batch_size: int | None = None, on_record: Any = None, stop: Any = None) -> list[Any]:
        """``items`` under ``spec`` (``workers.evaluation.evaluate_item`` each, replayed where ``references`` hold
        a target-only record's payload), ``batch_size`` at once (default :attr:`batch_size`; 1: one after another,
        today's engine): each record is the one batch 1 makes, token for token. ``on_record(record)`` as each
        finishes; ``stop()`` True: start no more items (the records of those not started are left out)."""
        from workers.evaluation import evaluate_item

        refs = references or {}
        batcher = self.batcher(batch_size, context=self._context(bench, items, spec))
        if batcher.size == 1:
            out = []
            for item in items:
                if stop is not None and stop():
                    break
                out.append(evaluate_item(self, bench, item, spec, refs.get(item.id)))
                if on_record is not None:
                    on_record(out[-1])
            return out
        from dataclasses import replace

        size = batcher.size
        jobs = [lambda row, item=item: replace(evaluate_item(row, bench, item, spec, refs.get(item.id)), batch=size)
                for item in items]
        done = batcher.run(jobs, on_done=None if on_record is None else (lambda _i, rec: on_record(rec)), stop=stop)
        return [r for r in done if r is not None]

    def evaluate_bundles(self, bench: Any, items: list[Any], specs: list[Any], references: dict[str, Any] | None = None,
                         *, batch_size: int | None = None) -> list[list[Any]]:
        """``workers.evaluation.evaluate_bundle`` on each item (every spec, one teacher-forced pass per item), the
        items ``batch_size`` at once as :meth:`evaluate_items` runs them."""
        from workers.evaluation import evaluate_bundle

        refs = references or {}
        batcher = self.batcher(batch_size, context=self._context(bench, items, specs[0]) if specs else 512)
        if batcher.size == 1:
            return [evaluate_bundle(self, bench, item, specs, refs.get(item.id)) for item in items]
        from dataclasses import replace

        size = batcher.size
        return batcher.run([lambda row, item=item: [replace(r, batch=size)
                                                    for r in evaluate_bundle(row, bench, item, specs, refs.get(item.id))]
                            for item in items])

    @resets_on_error
    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int] | Tensor,
        policy: Policy | str = "lossless",
        draft_len: int = 5,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        seed: int = 0,
        stop: list[str] | tuple[str, ...] | None = None,
        trace: bool = False,
        on_tokens: OnTokens | None = None,
        generated_prefix: list[int] | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        sampler: str = "standard",
    ) -> Generation:
        """Speculative decoding of ``prompt_ids`` with ``policy`` (a Policy or a registered name).

        ``on_tokens(new_ids)`` is called with the tokens each round emits (streaming); returning
        False from it ends generation there with finish reason ``"abort"`` (client gone).
        ``generated_prefix``: tokens already generated (a replay resuming at a block start): they follow the
        prompt, count against ``max_new_tokens`` and stop strings, and lead the returned ``token_ids``; the
        stats count only the rounds run here.

        At T = 0 every random number a rule draws (DropMatch's dropout masks) is keyed by ``seed`` and the
        draft slot's absolute position (``policies.randomness.PositionStreams``): a decision depends on its
        position's inputs alone, whatever the draft length or the rounds before (what replay relies on).

        ``top_k`` / ``top_p`` (T > 0 only; :mod:`policies.truncation`): the draft samples from its truncated
        distribution and every rule sees the target's truncated one, as a deployment that samples so would.

        ``sampler="coupled"`` (T > 0; :mod:`policies.coupling`): every token at sequence position t is a
        Gumbel-max sample with noise keyed by ``seed`` and t, the draft's with the same noise: lossless output is
        then target-only's under the same seed and sampler, token for token. A rule's own random numbers are then
        keyed by position too, as at T = 0, so a run replays from one teacher-forced pass (``workers.replay``)."""
        if isinstance(policy, str):
            policy = make_policy(policy)
        if not isinstance(draft_len, int) or draft_len < 1:
            raise ValueError(f"draft_len must be an integer >= 1, got {draft_len!r}")
        prompt, stopper, gen = self._start(prompt_ids, max_new_tokens, temperature, seed, stop, top_k, top_p)
        cut = (top_k, top_p)
        noise = self._noise(sampler, temperature, seed)
        generated: list[int] = list(generated_prefix or [])
        if len(generated) >= max_new_tokens:
            raise ValueError(f"generated_prefix holds {len(generated)} tokens: nothing left of max_new_tokens "
                             f"{max_new_tokens}")
        prompt = prompt + [int(t) for t in generated]
        stats = GenerationStats(draft_len=draft_len, accepted_per_position=[0] * draft_len)
        # the draft's whole distribution: always when sampling; at T = 0 only for a rule that reads it
        full = temperature > 0.0 or self.proposal is None or needs_draft_logits(policy)
        t_start = time.perf_counter()
        tokens = self._prefill(prompt, stats, draft=True)
        rounds: list[tuple[int, Tensor]] | None = [] if trace else None
        finish = None
        while finish is None:
            n_draft = min(draft_len, max_new_tokens - len(generated))  # never draft past the budget
            draft_ids, draft_logits = self._propose(tokens, n_draft, temperature, gen, stats, full, cut, noise)
            committed = len(tokens)
            t0 = time.perf_counter()
            feed = torch.tensor([[tokens[-1], *draft_ids]])
            assert self.target.length == committed - 1, "target cache must hold all but the last token"
            hidden = self.target.forward(feed)  # [1, L+1, d]
            target_logits = truncate(self.target.head(hidden), temperature, *cut)  # [1, L+1, V]
            stats.verify_time_s += time.perf_counter() - t0
            stats.target_forwards += 1
            if rounds is not None:
                rounds.append((committed - 1, target_logits[0].float().clone()))
            t0 = time.perf_counter()
            streams = PositionStreams(seed, torch.arange(committed, committed + n_draft).unsqueeze(0)) \
                if temperature == 0.0 or noise is not None else None
            result = verify(policy, VerifyBatch(
                draft_token_ids=torch.tensor([draft_ids]),
                draft_logits=draft_logits,
                target_logits=target_logits,
                target_hidden=hidden,
                lm_head_weight=self.lm_head_weight,
                lm_head_bias=self.lm_head_bias,
                temperature=temperature,
                generator=gen,
                streams=streams,
                coupling=None if noise is None else noise.at(range(committed, committed + n_draft + 1)).unsqueeze(0),
            ))
            n_acc = int(result.num_accepted[0])
            new = draft_ids[:n_acc] + [int(result.output_token_ids[0, n_acc])]
            stats.policy_time_s += time.perf_counter() - t0
            stats.num_drafts += 1
            stats.num_draft_tokens += n_draft
            stats.num_accepted_tokens += n_acc
            for i in range(n_acc):
                stats.accepted_per_position[i] += 1
            kept, finish = stopper.cut(generated, new)
            generated += kept
            tokens += new
            if on_tokens is not None and kept and on_tokens(kept) is False and finish is None:
                finish = "abort"
            if noise is not None:
                noise.release(len(tokens) - 1)  # the last token's position was drawn; the next block starts after it
            self.target.crop(committed + n_acc)  # all committed tokens but the emitted one
            if self.draft.length > len(tokens) - 1:
                self.draft.crop(len(tokens) - 1)
        return self._finish(generated, finish, stats, t_start, rounds, stopper.strings)

    @resets_on_error
    @torch.inference_mode()
    def autoregressive(
        self,
        prompt_ids: list[int] | Tensor,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        seed: int = 0,
        stop: list[str] | tuple[str, ...] | None = None,
        trace: bool = False,
        on_tokens: OnTokens | None = None,
        generated_prefix: list[int] | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
        sampler: str = "standard",
    ) -> Generation:
        """Target-only decoding: the reference every speculative run is compared with. ``generated_prefix``:
        tokens already generated (they follow the prompt, count against ``max_new_tokens`` and stop strings, and
        lead the returned ``token_ids``; the stats count only the steps run here). ``top_k`` / ``top_p``: as
        :meth:`generate`'s, the target's truncated distribution sampled at T > 0; ``sampler`` as :meth:`generate`'s."""
        prompt, stopper, gen = self._start(prompt_ids, max_new_tokens, temperature, seed, stop, top_k, top_p)
        noise = self._noise(sampler, temperature, seed)
        generated: list[int] = [int(t) for t in generated_prefix or []]
        if len(generated) >= max_new_tokens:
            raise ValueError(f"generated_prefix holds {len(generated)} tokens: nothing left of max_new_tokens "
                             f"{max_new_tokens}")
        prompt = prompt + generated
        stats = GenerationStats()
        t_start = time.perf_counter()
        tokens = self._prefill(prompt, stats, draft=False)
        rounds: list[tuple[int, Tensor]] | None = [] if trace else None
        finish = None
        while finish is None:
            t0 = time.perf_counter()
            logits = self.target.head(self.target.forward(torch.tensor([[tokens[-1]]])))[0, -1]  # [V]
            logits = truncate(logits, temperature, top_k, top_p)
            stats.verify_time_s += time.perf_counter() - t0
            stats.target_forwards += 1
            if rounds is not None:
                rounds.append((len(tokens) - 1, logits.float().clone().unsqueeze(0)))
            t0 = time.perf_counter()
            if noise is not None:
                noise.release(len(tokens))
            tok = self._pick(logits, temperature, gen) if noise is None else \
                int(perturbed_argmax(logits, temperature, noise.at([len(tokens)])[0]))
            stats.policy_time_s += time.perf_counter() - t0
            stats.num_drafts += 1
            kept, finish = stopper.cut(generated, [tok])
            generated += kept
            tokens.append(tok)
            if on_tokens is not None and kept and on_tokens(kept) is False and finish is None:
                finish = "abort"
        return self._finish(generated, finish, stats, t_start, rounds, stopper.strings)

    # -- the pieces -----------------------------------------------------------------------------

    def _start(self, prompt_ids: Any, max_new_tokens: int, temperature: float, seed: int, stop: Any,
               top_k: int = 0, top_p: float = 1.0):
        prompt = check_request(prompt_ids, self.pair.draft_width or self.pair.vocab_size, max_new_tokens, temperature)
        check_truncation(top_k, top_p)
        strings = tuple(s for s in (stop or ()) if s)
        if strings and self.pair.tokenizer is None:
            raise ValueError("stop strings need the pair's tokenizer")
        stopper = _Stop(frozenset(self.pair.eos_token_ids), strings, max_new_tokens, self.pair.tokenizer)
        return prompt, stopper, torch.Generator().manual_seed(int(seed))

    def _noise(self, sampler: str, temperature: float, seed: int) -> CoupledNoise | None:
        """The coupled sampler's noise for one generation; None under the standard sampler and at T = 0."""
        if check_sampler(sampler) == "standard" or temperature == 0.0:
            return None
        return CoupledNoise(seed, self.pair.vocab_size)

    def _prefill(self, prompt: list[int], stats: GenerationStats, draft: bool) -> list[int]:
        t0 = time.perf_counter()
        context = prompt[:-1]  # prefill logits are never used: the last prompt token starts decoding
        lms = (self.target, self.draft) if draft else (self.target,)
        for lm in lms:
            reused = lm.reuse(context) if self.prefix_cache else 0
            if not self.prefix_cache:
                lm.reset()
            if lm is self.target:
                stats.cached_prompt_tokens = reused
            if len(context) > reused:
                lm.forward(torch.tensor([context[reused:]]))  # no LM head in prefill
        stats.prompt_tokens = len(prompt)
        stats.prefill_time_s = time.perf_counter() - t0
        return list(prompt)

    def _propose(self, tokens: list[int], n: int, temperature: float, gen: torch.Generator,
                 stats: GenerationStats, full: bool = True, cut: tuple[int, float] = (0, 1.0),
                 noise: CoupledNoise | None = None) -> tuple[list[int], Tensor | None]:
        """Draft n tokens; return them and the draft logits that proposed them ([1, n, V]; None at T = 0 when
        ``full`` is False). At T = 0 with a proposal vocabulary each step scores only its ids
        (``workers.models.proposal``), and the whole head runs once over the n rows when ``full``."""
        t0 = time.perf_counter()
        missing = tokens[self.draft.length:]
        assert missing, "the draft cache may not run ahead of the committed tokens"
        feed = torch.tensor([missing])
        proposals: list[int] = []
        rows: list[Tensor] = []
        greedy_subset = temperature == 0.0 and self.proposal is not None
        for i in range(n):
            # clone: the last row of a 2-token forward keeps a row stride of 2*d; the bf16 linear
            # takes a ~35x slower path on such strides (measured 0.87 s vs 0.022 s per call).
            last = self.draft.forward(feed)[:, -1:].clone(memory_format=torch.contiguous_format)
            stats.draft_forwards += 1
            if greedy_subset:
                tok = int(self.proposal.argmax(last[0, 0]))
                rows.append(last)
            else:
                logits = truncate(self.draft.head(last), temperature, *cut)  # [1, 1, V]
                tok = self._pick(logits[0, 0], temperature, gen) if noise is None else \
                    int(perturbed_argmax(logits[0, 0], temperature, noise.at([len(tokens) + i])[0]))
                rows.append(logits)
            proposals.append(tok)
            if i < n - 1:
                feed = torch.tensor([[tok]])
        assert self.draft.length == len(tokens) + n - 1
        stacked = torch.cat(rows, dim=1)
        if greedy_subset:
            stacked = self.draft.head(stacked) if full else None  # hidden rows -> logits, one pass over the head
        stats.draft_time_s += time.perf_counter() - t0
        return proposals, stacked

    @staticmethod
    def _pick(logits: Tensor, temperature: float, gen: torch.Generator) -> int:
        if temperature == 0.0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    def _finish(self, generated: list[int], finish: str, stats: GenerationStats, t_start: float,
                rounds: list[tuple[int, Tensor]] | None, stop_strings: tuple[str, ...]) -> Generation:
        stats.num_generated = len(generated)
        stats.wall_time_s = time.perf_counter() - t_start
        text = None
        if self.pair.tokenizer is not None:
            text = self.pair.tokenizer.decode(generated, skip_special_tokens=True)
            if finish == "stop":
                cuts = [text.find(s) for s in stop_strings if s in text]
                text = text[: min(cuts)] if cuts else text
        return Generation(token_ids=generated, text=text, finish_reason=finish, stats=stats, trace=rounds)
