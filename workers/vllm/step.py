"""Deciding one verify step of vLLM's speculative decoding with a spectune rule; never a dead engine.

What it knows: vLLM's flat layout of a verify step (``[num_tokens, V]`` target logits, drafted tokens
concatenated over requests, ``num_draft_tokens`` per request, output ``[B, max_spec_len + 1]`` with
``-1`` after the last token) and spectune's rules (:func:`policies.ragged.verify_flat`). It groups a
step's requests by (rule, temperature), keys per-request random draws, falls back to the lossless rule
(then to greedy argmax) wherever a rule cannot decide, and counts every fallback per request in a
ledger (:data:`LEDGER`) with one warning per reason.

What it does not know: vLLM itself. Nothing here imports vllm (it imports in the main environment and
is tested there, ``tests/workers/vllm/test_rule_fallback.py``); :mod:`workers.vllm.plugin` patches vLLM,
collects a step's inputs (draft distribution, hidden states, per-request rules and seeds) and calls
:func:`decide_step`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from workers.vllm.host_syncs import to_device


def needs_draft_distribution(policy: Any) -> bool:
    """Whether ``policy`` reads the draft's distribution at T = 0 (``policies.registry.needs_draft_logits``)."""
    from policies.registry import needs_draft_logits

    return needs_draft_logits(policy)


def needs_hidden(policy: Any) -> bool:
    """Whether ``policy`` reads the target's hidden states and LM head (its declared
    ``policies.registry.Traits.needs_hidden``: DropMatch, a union holding it)."""
    from policies.registry import traits

    return traits(policy).needs_hidden


def draws_when_greedy(policy: Any) -> bool:
    """Whether ``policy`` draws random numbers at T = 0 too (``Traits.draws_when_greedy``: DropMatch's masks)."""
    from policies.registry import traits

    return traits(policy).draws_when_greedy


# -- never a dead engine: the lossless fallback, counted per request ---------------------------------

class _Ledger:
    """What the plugin decided in this process, per request (vLLM's internal request id) and in total:
    verify steps, lossless-fallback steps (and why), and which rule (digest) decided. The front end
    takes and clears it after each ``generate`` through the worker extension. Capped, so a process
    nobody asks (a server) keeps bounded memory."""

    CAP = 50_000

    def __init__(self) -> None:
        self.requests: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.totals: dict[str, Any] = {"verify_steps": 0, "request_steps": 0, "lossless_fallback_steps": 0,
                                       "reasons": {}}

    def record(self, req_ids: list[str] | None, num_draft_tokens: list[int], reasons: list[str | None],
               digests: list[str | None] | None = None, constrained: list[bool] | None = None) -> None:
        """``constrained``: the requests whose top-p / top-k the rule ignored this step (vLLM applied them to the
        bonus token only), counted per request as ``top_p_top_k_steps``."""
        self.totals["verify_steps"] += 1
        for i, (n, reason) in enumerate(zip(num_draft_tokens, reasons, strict=False)):
            if n <= 0:
                continue
            self.totals["request_steps"] += 1
            key = req_ids[i] if req_ids is not None and i < len(req_ids) else f"?{i}"
            entry = self.requests.setdefault(key, {"steps": 0, "lossless_fallback_steps": 0, "reasons": {},
                                                   "rules": {}})
            entry["steps"] += 1
            if constrained is not None and i < len(constrained) and constrained[i]:
                entry["top_p_top_k_steps"] = entry.get("top_p_top_k_steps", 0) + 1
                self.totals["top_p_top_k_steps"] = self.totals.get("top_p_top_k_steps", 0) + 1
            digest = digests[i] if digests is not None and i < len(digests) else None
            if digest is not None:
                entry["rules"][digest] = entry["rules"].get(digest, 0) + 1
            self.requests.move_to_end(key)
            if reason is None:
                continue
            self.totals["lossless_fallback_steps"] += 1
            self.totals["reasons"][reason] = self.totals["reasons"].get(reason, 0) + 1
            entry["lossless_fallback_steps"] += 1
            entry["reasons"][reason] = entry["reasons"].get(reason, 0) + 1
        while len(self.requests) > self.CAP:
            self.requests.popitem(last=False)

    def take(self, request_ids: list[str] | None = None) -> dict[str, Any]:
        """The per-request records (then forgotten) and the totals. ``request_ids``: only these
        requests' records (external ids; vLLM's internal "<external>-<suffix>" ids match them), the
        others stay for their own callers (a server's concurrent requests each take their own)."""
        if request_ids is None:
            taken = dict(self.requests)
            self.requests.clear()
        else:
            wanted = set(request_ids)
            taken = {k: self.requests.pop(k) for k in list(self.requests)
                     if k in wanted or k.rsplit("-", 1)[0] in wanted}
        return {"pid": os.getpid(), "requests": taken, "totals": json.loads(json.dumps(self.totals))}


LEDGER = _Ledger()
_warned: set[str] = set()


def _warn_once(reason: str, detail: str, fallback: bool = True) -> None:
    if reason in _warned:
        return
    _warned.add(reason)
    what = ("; the affected requests fall back to the lossless rule for such steps (counted per request as "
            "lossless_fallback_steps)") if fallback else ""
    logging.getLogger("vllm.spectune").warning("spectune vLLM plugin: %s%s (shown once per reason)%s", reason, what,
                                               f": {detail}" if detail else "")


def _reason(err: BaseException) -> str:
    from policies import MissingInputError

    if isinstance(err, InvalidRuleError):
        return "invalid per-request rule"
    if isinstance(err, MissingInputError):
        msg = str(err)
        if "draft_logits" in msg:
            return "missing draft distribution"
        if "target_hidden" in msg or "lm_head_weight" in msg:
            return "missing target hidden states"
        return "missing input"
    return f"rule error ({type(err).__name__})"


def _greedy_rows(draft_ids: torch.Tensor, num: torch.Tensor, target_logits: torch.Tensor, bonus: torch.Tensor,
                 max_len: int) -> torch.Tensor:
    """The last resort when even the lossless rule failed: accept drafts equal to the target argmax,
    emit the argmax at the first mismatch (the bonus token after a full run). Lossless at T = 0."""
    b = int(num.shape[0])
    out = torch.full((b, max_len + 1), -1, dtype=torch.long, device=draft_ids.device)
    argmax = target_logits.argmax(dim=-1) if target_logits.shape[0] else draft_ids.new_zeros(0)
    offset = 0
    for i, n in enumerate(num.tolist()):
        k = 0
        while k < n and int(draft_ids[offset + k]) == int(argmax[offset + k]):
            k += 1
        out[i, :k] = draft_ids[offset:offset + k]
        out[i, k] = int(argmax[offset + k]) if k < n else int(bonus[i])
        offset += n
    return out


SKIPPED = "drafter skipped or failed (placeholder drafts)"
GREEDY_AT_T = "greedy drafting at T > 0 (no draft distribution)"


@dataclass
class StepOutcome:
    output_token_ids: torch.Tensor  # [B, max_spec_len + 1] int32, vLLM's layout
    fallback: list[str | None]  # per request: None, or why the lossless rule decided this step


def keyed_seed(rule_seed: int, request_seed: int, position: int) -> int:
    """The generator seed of one request's verify step: (rule seed, request seed, position), the same
    in every process, rank and rerun, whatever else shares the batch."""
    blob = f"{int(rule_seed)}:{int(request_seed)}:{int(position)}".encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little") >> 1


def decide_step(policy: Any, *, draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
                target_logits: torch.Tensor, bonus_token_ids: torch.Tensor, temperatures: list[float],
                draft_logits: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                lm_head: Any = None, seed: int = 0, step: int = 0, trace: Any = None,
                policies: list[Any] | None = None, keys: list[str | None] | None = None,
                request_seeds: list[int | None] | None = None, skipped: list[bool] | None = None,
                greedy_drafts: bool = False, draft_scaled: bool = False) -> StepOutcome:
    """One verify step over vLLM's flat rows; never raises.

    Every request is decided by ``policy`` unless ``policies[i]`` gives its own rule (``keys[i]`` names
    it: requests with the same key share a rule). Requests are grouped by (rule, temperature), one
    vectorised :func:`verify_flat` per group, drawing from one generator seeded by (``seed``, ``step``)
    — or, for requests given ``request_seeds[i]`` (per-request rules), from their own keyed seed: a
    group whose rule draws random numbers (T > 0, DropMatch's dropout masks) then draws every request's
    numbers from a counter-based stream keyed by it (:class:`policies.randomness.RowStreams`), still in
    one call, so that each request's draws depend on its key only.

    Where the rule cannot decide a group — an input it needs is missing this step (vLLM passes no draft
    distribution when it lost a request's cached draft probabilities, no hidden states from an
    unsupported runner) or it raised — that group is decided by the lossless rule instead: at T = 0
    argmax matching; at T > 0 Leviathan's rule with the draft distribution when there is one, else
    with q one-hot at the draft token (accept with p_t(d), recover from p_t without d: vLLM's own
    fallback, exactly lossless for any drafter). The fallback is reported per request.
    ``lm_head`` is a callable returning the target's (weight, bias), called only when needed.

    ``skipped[i]``: vLLM did not run the drafter for request ``i``'s drafts (near ``max_model_len`` it
    skips it for the whole batch and fills the next step's drafts with token id 0, no distribution).
    Those drafts are no drafts: they become ``-1`` before any rule sees them, so every rule rejects the
    first one and the target's own token is emitted (sampled from p_t at T > 0, no residual), counted
    as a fallback (:data:`SKIPPED`). ``greedy_drafts``: the drafter proposed its argmax while some
    requests sample (T > 0), so the distribution it handed over is not the one the tokens came from;
    groups at T > 0 then get no draft distribution (q one-hot at the draft: exactly what was proposed),
    and a rule that reads q falls back to the lossless rule (:data:`GREEDY_AT_T`). ``draft_scaled``:
    ``draft_logits`` are the drafter's logits divided by each request's temperature, as the plugin hands them
    over (:attr:`policies.core.VerifyBatch.draft_scaled`).
    """
    from policies import make_policy
    from policies.ragged import verify_flat

    device = target_logits.device
    b = len(num_draft_tokens)
    num = to_device(num_draft_tokens, device)  # pinned, non-blocking: the host never waits for these copies
    bonus = bonus_token_ids.reshape(b, -1)[:, 0] if b else bonus_token_ids.reshape(0)
    out = torch.full((b, max_spec_len + 1), -1, dtype=torch.int32, device=device)
    fallback: list[str | None] = [None] * b
    starts = [0] * b
    for i in range(1, b):
        starts[i] = starts[i - 1] + int(num_draft_tokens[i - 1])
    temps = [float(t) for t in temperatures[:b]]
    skip = [bool(skipped is not None and i < len(skipped) and skipped[i] and num_draft_tokens[i] > 0)
            for i in range(b)]
    if any(skip):  # placeholder drafts: rows of those requests become -1 (host-side row list, no device read)
        rows_skipped = [starts[i] + k for i in range(b) if skip[i] for k in range(int(num_draft_tokens[i]))]
        draft_token_ids = draft_token_ids.clone()
        draft_token_ids[to_device(rows_skipped, draft_token_ids.device)] = -1
    own = [policies is not None and policies[i] is not None for i in range(b)]
    groups: dict[tuple[str, float], list[int]] = {}
    for i in range(b):
        key = (keys[i] or "") if own[i] and keys is not None else ""
        groups.setdefault((("r:" + key) if own[i] else "default", temps[i]), []).append(i)

    def decide(pol: Any, members: list[int], t: float, gen_seed: int, row_keys: list[int] | None = None) -> None:
        # the group's flat rows from the host-side draft counts: no device read (a GPU would wait for one)
        lengths = [int(num_draft_tokens[i]) for i in members]
        n_rows = sum(lengths)
        # the step's only group (one rule, one temperature: the common case) takes the rows as they are:
        # no copy of the [N, V] logits (~45 ms per step at 32 x 5 x 152k fp32 on this CPU), no index copied over
        whole = len(members) == b and n_rows == int(target_logits.shape[0])
        req = torch.arange(b, device=device) if whole else to_device(members, device)
        n_req = num if whole else num.index_select(0, req)
        rows = torch.arange(n_rows, device=device) if whole else to_device(
            [starts[i] + k for i in members for k in range(int(num_draft_tokens[i]))], device)
        pick = (lambda x: x) if whole else (lambda x: x.index_select(0, rows))  # noqa: E731
        inputs = dict(draft_token_ids=pick(draft_token_ids).long(), num_draft_tokens=n_req,
                      target_logits=pick(target_logits), bonus_token_ids=bonus.index_select(0, req),
                      temperature=t, lengths=lengths, draft_scaled=draft_scaled)
        greedy_q = greedy_drafts and t > 0  # the handed-over q is not what the argmax draft came from
        group_draft = None if draft_logits is None or greedy_q else pick(draft_logits)
        reason = detail = None
        hidden = weight = bias = None
        streams = None
        if row_keys is not None:  # each request's draws from its own key: one call for the whole group
            from policies.randomness import RowStreams

            keys_cpu = torch.tensor(row_keys, dtype=torch.int64)
            if device.type == "cuda":
                keys_cpu = keys_cpu.pin_memory()
            streams = RowStreams(keys_cpu.to(device, non_blocking=True))
        def draws() -> dict[str, Any]:
            """The group's random numbers, the same for the rule and its fallback: the requests' own streams
            (verify_flat never advances them), or the step's generator, seeded afresh."""
            if streams is not None:
                return {"streams": streams}
            return {"generator": torch.Generator(device=device).manual_seed(gen_seed)}

        try:
            if needs_hidden(pol) and target_hidden is not None:
                hidden = pick(target_hidden)
                weight, bias = lm_head() if lm_head is not None else (None, None)
            result = verify_flat(pol, **inputs, draft_logits=group_draft, target_hidden=hidden,
                                 lm_head_weight=weight, lm_head_bias=bias, **draws())
            used = pol
        except Exception as err:  # noqa: BLE001 - a worker must never die on a rule
            reason, detail = _reason(err), f"{type(err).__name__}: {err}"
            if greedy_q and reason == "missing draft distribution":
                reason = GREEDY_AT_T
            used = make_policy("lossless")
            try:
                result = verify_flat(used, **inputs, draft_logits=group_draft, **draws())
            except Exception as err2:  # noqa: BLE001
                reason = f"{reason}; lossless failed too ({type(err2).__name__}), greedy"
                detail = f"{detail}; then {type(err2).__name__}: {err2}"
                result = None
        if reason is not None:
            _warn_once(reason, detail or "")
            for i in members:
                fallback[i] = reason
        if result is None:
            tokens = _greedy_rows(inputs["draft_token_ids"], n_req, inputs["target_logits"],
                                  inputs["bonus_token_ids"], max(lengths, default=0))
        else:
            tokens = result.output_token_ids
        out[req, :tokens.shape[1]] = tokens.to(torch.int32)
        if trace is not None:
            trace(used, reason, t, gen_seed, rows, req, n_req, group_draft, hidden, weight, bias, tokens,
                  inputs["draft_token_ids"],  # the drafts the rule saw (skipped ones as -1)
                  row_keys)  # each request's stream key (None: the group drew from gen_seed's generator)

    for (_, t), members in sorted(groups.items()):
        pol = policies[members[0]] if own[members[0]] else policy
        keyed = [None if request_seeds is None else request_seeds[i] for i in members] if own[members[0]] \
            else [None] * len(members)
        if all(k is None for k in keyed):
            decide(pol, members, t, seed * 1_000_003 + step)
        elif t > 0 or draws_when_greedy(pol):  # draws random numbers: each request from its own key, one call
            decide(pol, members, t, 0, row_keys=[k or 0 for k in keyed])
        else:  # deterministic given its inputs: one vectorised call
            decide(pol, members, t, keyed[0] or 0)
    if any(skip):
        _warn_once(SKIPPED, "vLLM skipped the drafter near max_model_len, or drafting for the rules failed: those "
                            "drafts are rejected, the target's token is emitted")
        for i in range(b):
            if skip[i] and fallback[i] is None:
                fallback[i] = SKIPPED
    return StepOutcome(out, fallback)


def _lossless_everywhere(reason: str, detail: str, draft_token_ids, num_draft_tokens, max_spec_len, target_logits,
                         bonus_token_ids, sampling_metadata, req_ids: list[str] | None = None,
                         skipped: list[bool] | None = None, step: int = 0) -> torch.Tensor:
    """The guard's answer when the plugin itself failed before a rule could run: lossless for every
    request of the step (q one-hot: no input is trusted), counted under ``req_ids`` (vLLM's request ids
    in batch order), one warning per reason. ``skipped``: the drafter's placeholders (rejected, counted as
    such); ``step``: the step counter, so that fallback steps do not all draw the same numbers."""
    from policies import make_policy

    _warn_once(reason, detail)
    b = len(num_draft_tokens)
    try:
        greedy = sampling_metadata.all_greedy or sampling_metadata.temperature is None
        temps = [0.0] * b if greedy else sampling_metadata.temperature.float().clamp(min=0.0)[:b].tolist()
    except Exception:  # noqa: BLE001
        temps = [0.0] * b
    outcome = decide_step(make_policy("lossless"), draft_token_ids=draft_token_ids, num_draft_tokens=num_draft_tokens,
                          max_spec_len=max_spec_len, target_logits=target_logits, bonus_token_ids=bonus_token_ids,
                          temperatures=temps, step=step,
                          skipped=skipped if skipped is not None and len(skipped) >= b else None)
    try:
        LEDGER.record(req_ids, num_draft_tokens, [reason] * b)
    except Exception:  # noqa: BLE001
        pass
    return outcome.output_token_ids


class _InvalidRule:
    """A request's rule that does not build: deciding raises, so the lossless rule decides, counted."""

    name = "invalid"

    def __init__(self, error: str) -> None:
        self.error = error
        self.config = None

    def decide(self, batch: Any) -> Any:
        raise InvalidRuleError(self.error)


class InvalidRuleError(ValueError):
    pass


def constrained_rows(sampling_metadata: Any, b: int, vocab: int) -> list[bool] | None:
    """Which of the step's ``b`` requests ask for top-p < 1 or top-k below the vocabulary (vLLM's per-request
    tensors, set only when some request of the batch does: None otherwise, the common case, and no read)."""
    top_p, top_k = getattr(sampling_metadata, "top_p", None), getattr(sampling_metadata, "top_k", None)
    if top_p is None and top_k is None:
        return None
    flags = torch.zeros(b, dtype=torch.bool)
    if top_p is not None:
        flags |= (top_p[:b].float() < 1.0).cpu()
    if top_k is not None:
        flags |= ((top_k[:b] > 0) & (top_k[:b] < vocab)).cpu()
    return flags.tolist()
