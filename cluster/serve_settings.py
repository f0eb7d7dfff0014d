"""What a Serve replica is started with (:class:`ServeSettings`, validated on construction, plain JSON so
it travels in a Serve config file) and what it counts (:class:`ServeMetrics`, through Ray's metrics agent).

Imports no Ray and no web framework at module level: ``jobs.serve`` builds and checks settings before Ray
starts. The app that runs them is :mod:`cluster.serve_app`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from cluster.openai_api import Limits, SpecChoice


@dataclass
class ServeSettings:
    """Everything a replica needs; plain JSON so it travels in a Serve config file."""

    pair: str = "qwen2.5-coder-0.5b+1.5b"
    dtype: str = "bf16"
    policy: str | None = "lossless"  # None: speculation off by default
    params: dict[str, Any] = field(default_factory=dict)
    draft_len: int = 5
    source: dict[str, Any] = field(default_factory=lambda: {"kind": "flags"})  # how the policy was chosen
    model_name: str | None = None  # the OpenAI "model" id (default: spectune/<pair>)
    limits: dict[str, int] = field(default_factory=dict)  # overrides of Limits' defaults
    num_replicas: int = 1
    num_cpus: float = 1.0  # per replica; also its torch threads (rounded, at least 1)
    max_ongoing_requests: int = 8
    max_queued_requests: int = 32
    prefix_cache: bool = True
    engine: str = "cpu"  # "vllm" on GPU nodes: vLLM with spectune's rule inside its verification
    tensor_parallel_size: int = 1  # vLLM: GPUs per replica (give the replica as many in num_gpus)
    num_gpus: float = 0  # per replica
    vllm: dict[str, Any] = field(default_factory=dict)  # VLLMSettings fields (memory fraction, max_model_len)
    # The environment variable that holds the API key in every replica's environment (the name, never the key: it
    # travels in Serve configs). Set: every /v1 request must carry ``Authorization: Bearer <key>`` or is a 401.
    api_key_env: str | None = None
    # Fault injection for tests of the error path: a prompt containing this text fails inside the
    # engine after its first round (off unless set; the text itself is never executed).
    fail_marker: str | None = None

    def __post_init__(self) -> None:
        self.limits_obj()  # bad limits fail here, before anything starts
        self.default_spec().build()  # unknown policy / params / ranges fail here
        for name in ("num_replicas", "max_ongoing_requests", "max_queued_requests", "draft_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.num_cpus, (int, float)) and self.num_cpus > 0):
            raise ValueError(f"num_cpus must be > 0, got {self.num_cpus!r}")
        if not (isinstance(self.num_gpus, (int, float)) and self.num_gpus >= 0):
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus!r}")
        if self.api_key_env is not None and not (isinstance(self.api_key_env, str)
                                                  and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env)):
            raise ValueError(f"api_key_env must name an environment variable (letters, digits, _), got "
                             f"{self.api_key_env!r}: the name of the variable holding the key, not the key")
        from workers.engines import check_engine

        check_engine(self.engine, draft_lens=(self.draft_len, self.draft_len),
                     tensor_parallel_size=self.tensor_parallel_size, vllm=self.vllm)

    @property
    def model(self) -> str:
        return self.model_name or f"spectune/{self.pair}"

    def api_key(self) -> str | None:
        """The key every /v1 request must carry (read from this process's environment), or None where no key is
        asked for. A named variable that is unset or empty is an error: the server never runs open by mistake."""
        import os

        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env, "")
        if not key.strip():
            raise ValueError(f"api_key_env {self.api_key_env}: that environment variable is "
                             f"{'empty' if self.api_key_env in os.environ else 'not set'} in this process "
                             f"(pid {os.getpid()}); it must hold the API key wherever a replica runs (Kubernetes: "
                             "from a Secret)")
        return key.strip()

    def limits_obj(self) -> Limits:
        unknown = sorted(set(self.limits) - {f.name for f in dataclasses.fields(Limits)})
        if unknown:
            raise ValueError(f"unknown limit {unknown[0]!r}; known: {[f.name for f in dataclasses.fields(Limits)]}")
        return Limits(**self.limits)

    def default_spec(self) -> SpecChoice:
        return SpecChoice(self.policy, dict(self.params), self.draft_len)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ServeSettings:
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(ServeSettings)})
        if unknown:
            raise ValueError(f"unknown serve setting {unknown[0]!r}")
        return ServeSettings(**d)


class ServeMetrics:
    """Aggregates exported through Ray's metrics agent (Prometheus names get a ``ray_`` prefix)."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter, Histogram

        keys = ("route", "status")
        self.requests = Counter("spectune_requests", description="HTTP requests answered", tag_keys=keys)
        by = ("policy",)
        self.prompt = Counter("spectune_prompt_tokens", description="prompt tokens", tag_keys=by)
        self.generated = Counter("spectune_generated_tokens", description="generated tokens", tag_keys=by)
        self.drafts = Counter("spectune_num_drafts", description="verify rounds", tag_keys=by)
        self.draft_tokens = Counter("spectune_num_draft_tokens", description="draft tokens proposed", tag_keys=by)
        self.accepted = Counter("spectune_num_accepted_tokens", description="draft tokens accepted", tag_keys=by)
        self.latency = Histogram("spectune_request_latency_s", description="request latency (s)",
                                 boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160], tag_keys=("route",))
        self.ttft = Histogram("spectune_time_to_first_token_s", description="time to first streamed token (s)",
                              boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40], tag_keys=("route",))
        self.certified = Counter("spectune_requests_in_certificate", description="generations by whether they ran "
                                 "the served rule inside its certificate (rule and temperature)",
                                 tag_keys=("in_certificate",))
        self.mal = Histogram("spectune_mean_acceptance_length", description="per-request mean acceptance length",
                             boundaries=[1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 12, 17], tag_keys=by)

    def answered(self, route: str, status: int, seconds: float | None = None) -> None:
        self.requests.inc(1, tags={"route": route, "status": str(status)})
        if seconds is not None and status == 200:
            self.latency.observe(seconds, tags={"route": route})

    def generation(self, spec: SpecChoice, gen: Any, inside: bool = False) -> None:
        self.certified.inc(1, tags={"in_certificate": str(bool(inside)).lower()})
        tags = {"policy": spec.policy or "off"}
        s = gen.stats
        self.prompt.inc(s.prompt_tokens, tags=tags)
        self.generated.inc(s.num_generated, tags=tags)
        if spec.policy is not None:
            self.drafts.inc(s.num_drafts, tags=tags)
            self.draft_tokens.inc(s.num_draft_tokens, tags=tags)
            self.accepted.inc(s.num_accepted_tokens, tags=tags)
            if s.num_drafts:
                self.mal.observe(s.mean_acceptance_length, tags=tags)
