"""Ray at the edge: connect to a cluster or start a local one with embedded defaults.

``--address`` / ``RAY_ADDRESS`` connects to an existing cluster (a ``ray start --head`` on this
machine, a KubeRay head...). Otherwise a local Ray is started sized to the machine: all CPUs, a
small object store (records are small; the default 30% of RAM is memory the models need), no
dashboard unless asked, usage stats off, everything on 127.0.0.1. ``RAY_AUTH_MODE`` is set to
``token`` unless given (when Ray is not imported yet: it reads the variable at import), the same
value ``scripts/ray-head`` and ``ray job submit`` use — mixing modes between cluster and client
is what makes job submission fail with an auth error.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from workers.engine_registry import PLUGINS_ENV

AUTH_MODE = "token"
DEFAULT_OBJECT_STORE_BYTES = 256 << 20
# Serve's proxy must answer its readiness check within 5 s by default; on a busy 2-core node
# (a model loading next to it) starting uvicorn takes longer and the controller kills it in a
# loop. The controller and proxy read these from their environment (inherited from here).
SERVE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
# the engines' switches, set by the driver: its actors must decode as it was told (a cluster's workers do not
# inherit the driver's environment)
ENGINE_ENV = ("SPECTUNE_FUSED", "SPECTUNE_SCRIPTED_STEP")


def configure_env() -> None:
    # Ray reads RAY_AUTH_MODE once, at import. Setting it after `import ray` would start a GCS in
    # token mode that this very process then cannot talk to, so only default it before import.
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", AUTH_MODE)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)


def init_ray(address: str | None = None, *, num_cpus: int | None = None, object_store_bytes: int | None = None,
             dashboard: bool = False, quiet: bool = True) -> dict[str, Any]:
    """Connect or start; idempotent. Returns ``ray.cluster_resources()``. A bad engine switch
    (``ENGINE_ENV``) fails here, naming it, before any actor starts with it."""
    from policies import fused
    from workers.models import fast_step

    fused.mode()
    fast_step.enabled()
    configure_env()
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    address = address or os.environ.get("RAY_ADDRESS")
    # Ship our packages to workers by path: jobs submitted with --working-dir already run there;
    # a local driver's workers share this checkout, so adding it to PYTHONPATH is enough.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
                        **{k: os.environ[k] for k in SERVE_ENV},
                        **{k: os.environ[k] for k in ENGINE_ENV if k in os.environ},
                        # engines registered outside workers.engine_registry: the actors import them too
                        **{k: os.environ[k] for k in (PLUGINS_ENV,) if k in os.environ}}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=not quiet, configure_logging=quiet)
    else:
        # "local": always a fresh local Ray. Without it ray.init() joins a head already running on
        # this machine (`make ray-head`) and then refuses the sizing arguments with a traceback.
        ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            object_store_memory=object_store_bytes or DEFAULT_OBJECT_STORE_BYTES,
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            _node_ip_address="127.0.0.1",
            runtime_env=env,
            log_to_driver=not quiet,
            configure_logging=quiet,
        )
    return ray.cluster_resources()


def default_num_actors(memory_per_actor_bytes: int, cpus_per_actor: int = 1) -> int:
    """As many pair actors as memory and CPUs allow (at least one)."""
    import ray

    res = ray.cluster_resources()
    by_cpu = int(res.get("CPU", 1) // cpus_per_actor)
    by_mem = int(res.get("memory", memory_per_actor_bytes) // memory_per_actor_bytes)
    return max(1, min(by_cpu, by_mem))
