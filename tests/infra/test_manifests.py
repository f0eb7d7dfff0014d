"""infra/ against the code: every manifest parses, entry points and flags exist and validate,
resources fit what the engine settings ask for, volumes and cache paths agree, the image pins
what pyproject pins."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra" / "k8s"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def all_docs() -> list[dict]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in docs(p.name)]


def quantity(value: str | int) -> float:
    """Kubernetes quantities: "500m" CPU, "16Gi" memory (in GiB)."""
    text = str(value)
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    units = {"Gi": 1.0, "Mi": 1 / 1024, "Ti": 1024.0}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def pod_specs(doc: dict) -> list[dict]:
    spec = doc["spec"]
    cluster = spec.get("rayClusterConfig", spec) if doc["kind"] in ("RayCluster", "RayService") else None
    if cluster is not None:
        return [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    if doc["kind"] == "Job":
        return [spec["template"]["spec"]]
    return [spec["submitterPodTemplate"]["spec"]] if "submitterPodTemplate" in spec else []


def test_every_manifest_parses_with_kind_and_api_version():
    kinds = {(d["apiVersion"], d["kind"]) for d in all_docs()}
    assert {("ray.io/v1", "RayCluster"), ("ray.io/v1", "RayJob"), ("ray.io/v1", "RayService"),
            ("batch/v1", "Job"), ("v1", "PersistentVolumeClaim")} <= kinds
    assert all(d["metadata"]["name"] for d in all_docs())


def gpus(resources: dict) -> float:
    return quantity(resources.get("limits", {}).get("nvidia.com/gpu", 0))


@pytest.mark.parametrize("variant", ["", "-gpu"])
def test_rayjob_entrypoint_is_a_real_script_with_flags_the_sweep_accepts(variant):
    from jobs import sweep as sweep_job

    (job,) = docs(f"rayjob-sweep{variant}.yaml")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "jobs/sweep.py"] and (ROOT / argv[1]).is_file()
    args = sweep_job.build_parser().parse_args(argv[2:])  # an unknown flag exits here
    settings = sweep_job.parse_settings(args)  # pair, budgets, policies, draft lengths validate
    assert args.items == 0 and args.shots == 8 and settings["budgets"] == [0.01, 0.02, 0.05]
    # each worker pod must hold at least one pair actor of the size the sweep plans
    (cluster,) = [d for d in docs(f"raycluster{variant}.yaml") if d["kind"] == "RayCluster"]
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        resources = group["template"]["spec"]["containers"][0]["resources"]
        limits = resources["limits"]
        assert quantity(limits["cpu"]) >= args.cpus_per_actor
        assert quantity(group["rayStartParams"]["num-cpus"]) >= args.cpus_per_actor
        assert quantity(limits["memory"]) >= args.actor_memory_gb
        # GPUs: the pod holds what Ray advertises, which holds one actor's TP group
        assert gpus(resources) == quantity(group["rayStartParams"].get("num-gpus", 0))
        assert gpus(resources) >= args.gpus_per_actor
    if variant:
        assert args.engine == "vllm" and args.gpus_per_actor >= args.tensor_parallel_size > 1
        assert settings["draft_len"][0] == settings["draft_len"][1], "vLLM runs one draft length"
        head = cluster["spec"]["headGroupSpec"]
        assert head["rayStartParams"]["num-gpus"] == "0", "no GPU work on the head"
    else:
        assert args.engine == "cpu" and args.gpus_per_actor == 0


@pytest.mark.parametrize("variant", ["", "-gpu"])
def test_rayservice_serve_config_validates_and_builds_settings(variant):
    from ray.serve.schema import ServeDeploySchema

    from cluster.serve_app import ServeSettings

    (svc,) = docs(f"rayservice{variant}.yaml")
    config = yaml.safe_load(svc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    module, attr = app["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), attr))
    args = dict(app["args"])
    assert args.pop("policy_file").startswith("/runs/")  # the chosen policy comes from the runs volume
    settings = ServeSettings.from_dict(args)
    workers = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    per_pod = max(quantity(g["rayStartParams"]["num-cpus"]) for g in workers)
    assert settings.num_cpus <= per_pod, "a replica must fit on one worker pod"
    assert settings.num_replicas <= sum(g["maxReplicas"] for g in workers) * (per_pod // settings.num_cpus)
    pod_gpus = max(gpus(g["template"]["spec"]["containers"][0]["resources"]) for g in workers)
    assert settings.num_gpus <= pod_gpus and settings.tensor_parallel_size <= max(settings.num_gpus, 1)
    assert settings.engine == ("vllm" if variant else "cpu")
    assert config["http_options"]["port"] in [p["containerPort"] for p in
                                               svc["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
                                               ["containers"][0]["ports"]]


def test_prefetch_job_runs_commands_that_exist():
    from workers.models import assets

    (job,) = docs("prefetch-assets.yaml")
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    calls = re.findall(r"python -m ([\w.]+) (\w+)", script)
    assert {m for m, _ in calls} == {"workers.models.assets", "workers.benchmarks"}
    assert {c for _, c in calls} == {"fetch", "verify"}
    for module, _ in calls:
        assert importlib.util.find_spec(module) is not None
    assert assets.cache_root is not None


@pytest.mark.parametrize("doc", all_docs(), ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_volumes_claims_and_cache_paths_agree(doc):
    claims = {d["metadata"]["name"] for d in docs("assets-pvc.yaml")}
    for pod in pod_specs(doc):
        mounts = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
                  if "persistentVolumeClaim" in v}
        assert set(mounts.values()) <= claims
        for c in pod["containers"]:
            env = {e["name"]: e["value"] for e in c.get("env", [])}
            paths = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            if "SPECTUNE_CACHE" in env:
                assert env["SPECTUNE_CACHE"] in paths, "the asset cache must be the mounted volume"
            if "SPECTUNE_RUNS" in env:
                assert not paths[env["SPECTUNE_RUNS"]].get("readOnly"), "runs are written"
            gpu_pod = any("nvidia.com/gpu" in r for r in c.get("resources", {}).values())
            assert c["image"] == ("spectune:gpu" if gpu_pod or doc["metadata"]["name"].endswith("-gpu") else
                                  "spectune:dev"), "GPU pods run the vLLM image, CPU pods the CPU one"


def test_image_pins_torch_as_pyproject_does():
    dockerfile = (ROOT / "infra" / "docker" / "Dockerfile").read_text()
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f'"torch=={pin}"' in dockerfile and "pip install ." in dockerfile
    for package in ("policies", "workers", "cluster", "jobs", "dashboards"):
        assert f"COPY {package} ./{package}" in dockerfile


def test_gpu_image_installs_vllm_as_the_extra_pins_and_declares_the_plugin():
    dockerfile = (ROOT / "infra" / "docker" / "Dockerfile.gpu").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'vllm = \["vllm==([\d.]+)"\]', pyproject).group(1)
    assert f'"vllm=={pin}"' in dockerfile
    assert "pip install --no-deps ." in dockerfile and "spectune_rules" in dockerfile
    assert 'spectune_rules = "workers.vllm.plugin:register"' in pyproject
    for package in ("policies", "workers", "cluster", "jobs", "dashboards"):
        assert f"COPY {package} ./{package}" in dockerfile
