"""A running server that speaks spectune's rule fields (``jobs.serve``, or any server taking ``spec_decode``) as
an engine the sweep's pair actors host: the actors become clients, and every ``DecodeSpec`` becomes a request.

- target-only decoding: ``{"spec_decode": {"policy": "off"}}``;
- a rule at L (lossless included): ``{"spec_decode": {"policy", "params", "draft_len"}}``.

Every reply must report the rule it ran (``spec_decode`` in the reply): one that reports another rule, knobs or
draft length, or none, makes the item's record fail with that reason, so a server that ignores the knobs can
never produce evidence for a certificate (a failed candidate item counts against it). c is not measured through
a server: the sweep asks for ``--cost-ratio``, and speed is timed request by request (batch 1 per actor), or
at ``--concurrency`` C with C requests in flight (:meth:`EndpointEngine.time_concurrent`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from workers.endpoint import Endpoint, check
from workers.endpoint_eval import Side, fetch, record_of, reported, warm
from workers.evaluation import TARGET_ONLY, DecodeSpec, Record


def spec_body(spec: DecodeSpec) -> dict[str, Any]:
    """The request fields that make a spectune server run ``spec``."""
    if spec.policy == TARGET_ONLY:
        return {"spec_decode": {"policy": "off"}}
    from policies import make_policy

    params = make_policy(spec.policy, **spec.params_dict).config.to_dict()
    return {"spec_decode": {"policy": spec.policy, "params": params, "draft_len": spec.draft_len}}


def ran_as_asked(spec: DecodeSpec, report: dict[str, Any] | None) -> str | None:
    """None when the server's rule report is ``spec``'s rule, else why not."""
    if report is None:
        return "the server sent no rule report (spec_decode): it does not run spectune's rules"
    if spec.policy == TARGET_ONLY:
        return None if report.get("enabled") is False else f"asked for speculation off, the server ran {report}"
    want = spec_body(spec)["spec_decode"]
    got = {"policy": report.get("policy"), "params": report.get("params") or {}, "draft_len": report.get("draft_len")}
    return None if got == want else f"asked for {want}, the server ran {got}"


class EndpointEngine:
    """One server, as the sweep's actors use an engine (``evaluate_item`` and ``profile``)."""

    kind = "openai"

    def __init__(self, endpoint: dict[str, Any]) -> None:
        self.endpoint = Endpoint(**endpoint)
        self.card = check(self.endpoint)  # an unreachable server fails the actor's start, in one line

    def profile(self) -> dict[str, Any]:
        return {"pair": "endpoint", "engine": self.kind, "cost_ratio": None, "verify_s": {},
                "endpoint": self.endpoint.describe(),
                "model_card": self.card}

    def time_concurrent(self, bench: Any, specs: list[DecodeSpec], items: list[Any], concurrency: int
                        ) -> tuple[list[list[Record]], list[float]]:
        """The speed phase at a concurrency: the items in chunks of 8 x ``concurrency`` (at least 16); in each chunk
        every spec in turn, the one that goes first rotating (a server's prefix cache warms each arm's prompts for
        the others alike), its requests ``concurrency`` at a time. Scoring runs after each arm's clock stops. The
        records per spec in item order, and each spec's wall seconds over its own chunks."""
        import time

        from workers.endpoint import run_concurrently
        from workers.metrics.speed import rotation

        out: list[list[Record]] = [[] for _ in specs]
        walls = [0.0] * len(specs)
        sides = [self._side(spec) for spec in specs]
        size = max(8 * concurrency, 16)
        for k, start in enumerate(range(0, len(items), size)):
            chunk = items[start: start + size]
            warm([self.endpoint], bench, chunk, concurrency, shots=specs[0].shots)  # untimed: no arm runs colder
            for j in rotation(k, len(specs)):
                spec, side = specs[j], sides[j]
                t0 = time.perf_counter()
                got = run_concurrently(lambda it, spec=spec, side=side: self._fetch(side, bench, it, spec), chunk,
                                       concurrency)
                walls[j] += time.perf_counter() - t0
                out[j].extend(self._record(side, bench, g, spec, None) for g in got)
        return out, walls

    @staticmethod
    def _fetch(side: Side, bench: Any, item: Any, spec: DecodeSpec) -> Any:
        return fetch(side, bench, item, shots=spec.shots, max_new_tokens=spec.max_new_tokens,
                     temperature=spec.temperature, seed=spec.seed)

    def _side(self, spec: DecodeSpec) -> Side:
        if spec.sampler != "standard":
            raise ValueError("a server draws its own tokens: the coupled sampler runs on the CPU engine")
        label = "reference" if spec.policy == TARGET_ONLY else "candidate"
        ep = replace(self.endpoint, extra_body={**self.endpoint.extra_body, **spec_body(spec), **spec.truncation()})
        return Side(label, ep, spec.policy, spec.params_dict, spec.draft_len)

    @staticmethod
    def _record(side: Side, bench: Any, got: Any, spec: DecodeSpec, reference: Any) -> Record:
        refs = reference.get("outputs") if isinstance(reference, dict) else reference
        record = record_of(side, bench, got, spec.key(), refs)
        if not record.failed:
            wrong = ran_as_asked(spec, reported(record))
            if wrong is not None:
                record.score, record.error = math.nan, f"KnobsIgnored: {wrong}"
                record.reason = f"failed: {wrong}"
        return record

    def evaluate_item(self, bench: Any, item: Any, spec: DecodeSpec, reference: Any = None) -> Record:
        side = self._side(spec)
        return self._record(side, bench, self._fetch(side, bench, item, spec), spec, reference)
