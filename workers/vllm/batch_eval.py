"""Benchmark items through a vLLM engine in batches: each turn of every item in one ``generate``.

Knows the benchmark contract (messages per turn, stop strings) and :func:`workers.evaluation.evaluate_item`;
the records come out exactly as item by item (scores, per-item statistics, errors), since
``evaluate_item`` builds them from generations replayed in call order. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from policies import make_policy
from workers.stats import Generation


class _Replay:
    """An engine that hands back generations already made (batched), in call order, so
    :func:`workers.evaluation.evaluate_item` builds and scores every record exactly as per item."""

    def __init__(self, pair: Any, results: list[Any]) -> None:
        self.pair = pair
        self._results = list(results)

    def _next(self) -> Generation:
        result = self._results.pop(0)
        if isinstance(result, BaseException):
            raise result
        return result

    def generate(self, *args: Any, **kwargs: Any) -> Generation:
        return self._next()

    def autoregressive(self, *args: Any, **kwargs: Any) -> Generation:
        return self._next()


def evaluate_items(decoder: Any, bench: Any, items: Sequence[Any], spec: Any,
                   references: dict[str, list[str]] | None = None) -> list[Any]:
    """:func:`workers.evaluation.evaluate_item` for a whole list of items, each turn of every item in
    one batched ``generate``; the same records (scores, per-item statistics, errors) as item by item."""
    from workers.evaluation import TARGET_ONLY, evaluate_item
    from workers.prompts import encode_chat

    if getattr(spec, "sampler", "standard") != "standard":
        raise ValueError("the vLLM engine draws its own tokens: the coupled sampler runs on the CPU engine")
    if getattr(spec, "truncation", dict)():
        raise ValueError(f"{spec.truncation()}: the vLLM engine cannot sample with top-k / top-p (its plugin "
                         "refuses them at admission)")
    references = references or {}
    policy = None if spec.policy == TARGET_ONLY else make_policy(spec.policy, **spec.params_dict)
    results: list[list[Any]] = [[] for _ in items]
    previous: list[list[tuple[str, str]]] = [[] for _ in items]
    for turn in range(max((len(item.turns) for item in items), default=0)):
        idx, prompts = [], []
        for i, item in enumerate(items):
            if turn >= len(item.turns) or any(isinstance(r, BaseException) for r in results[i]):
                continue
            try:
                prompts.append(encode_chat(decoder.pair.tokenizer, bench.messages(item, shots=spec.shots, turn=turn,
                                                                             previous=previous[i]),
                                           getattr(bench, "chat", None)))
                idx.append(i)
            except Exception as err:  # noqa: BLE001 - recorded on the item by evaluate_item
                results[i].append(err)
        if not idx:
            continue
        common = dict(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, seeds=spec.seed + turn,
                      stop=list(bench.stop) or None)
        try:
            if policy is None:
                gens = decoder.autoregressive_batch(prompts, **common)
            else:
                gens = decoder.generate_batch(prompts, policy, draft_len=spec.draft_len, **common)
        except Exception as err:  # noqa: BLE001 - the whole batch failed: every item records it
            gens = [err] * len(idx)
        for i, gen in zip(idx, gens, strict=True):
            results[i].append(gen)
            if isinstance(gen, Generation):
                previous[i].append((items[i].turns[turn], gen.text or ""))
    return [evaluate_item(_Replay(decoder.pair, results[i]), bench, item, spec, references.get(item.id))
            for i, item in enumerate(items)]
