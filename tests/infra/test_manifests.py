"""infra/ against the code: every manifest parses, entry points and flags exist and validate,
resources fit what the engine settings ask for, volumes and cache paths agree, the image pins
what pyproject pins."""

from __future__ import annotations

import importlib
import re
import shlex
import subprocess
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


def entrypoint_steps(job: dict) -> list[list[str]]:
    """The entrypoint's commands, each as argv: one command, or the statements of one `bash -c '...'`
    word (KubeRay's submitter pastes the entrypoint into a shell line: only a single quoted word reaches
    Ray untouched). Checked with `bash -n`."""
    argv = shlex.split(job["spec"]["entrypoint"])
    if argv[:2] != ["bash", "-c"]:
        return [argv]
    assert len(argv) == 3, "the whole script must be the one quoted word after bash -c"
    check = subprocess.run(["bash", "-n", "-c", argv[2]], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    return [shlex.split(statement) for statement in argv[2].split(";") if statement.strip()]


def sweep_argv(job: dict) -> list[str]:
    (argv,) = [a for a in entrypoint_steps(job) if a[:2] == ["python", "jobs/sweep.py"]]
    return argv


@pytest.mark.parametrize("variant", ["", "-gpu"])
def test_rayjob_entrypoint_is_a_real_script_with_flags_the_sweep_accepts(variant):
    from jobs import sweep as sweep_job

    (job,) = docs(f"rayjob-sweep{variant}.yaml")
    argv = sweep_argv(job)
    assert (ROOT / argv[1]).is_file()
    # the GPU job's c is the figure its calibration step measured (a shell variable): any number parses
    argv = ["0.5" if a == "$c" else a for a in argv]
    args = sweep_job.build_parser().parse_args(argv[2:])  # an unknown flag exits here
    from sweep.settings import parse_settings

    settings = parse_settings(args)  # pair, budgets, policies, draft lengths validate
    assert args.items == 0 and args.shots == 8 and settings.budgets == [0.01, 0.02, 0.05]
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
        assert settings.draft_len[0] == settings.draft_len[1], "vLLM runs one draft length"
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
    # bound to 0.0.0.0: a key is asked for, and every pod a replica may run on holds it from a Secret, required
    # (no Secret, no pod: the endpoint never runs open); the head runs no replica
    assert config["http_options"]["host"] == "0.0.0.0" and settings.api_key_env
    for group in workers:
        (var,) = [e for e in group["template"]["spec"]["containers"][0]["env"] if e["name"] == settings.api_key_env]
        ref = var["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == SECRET and not ref.get("optional") and "value" not in var
    assert svc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
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
    # the pair's metadata directory exists before pods mount the volume read-only (pair_dirs makes it)
    pairs = set(re.findall(r"pair_dirs\('([^']+)'\)", script))
    jobs_pairs = {a[a.index("--pair") + 1] for d in all_docs() if d["kind"] == "RayJob" for a in [sweep_argv(d)]
                  if "openai" not in a}  # a server's pair is the server's, not on the volume
    assert jobs_pairs and jobs_pairs <= pairs


@pytest.mark.parametrize("doc", all_docs(), ids=lambda d: f"{d['kind']}-{d['metadata']['name']}")
def test_volumes_claims_and_cache_paths_agree(doc):
    claims = {d["metadata"]["name"] for d in docs("assets-pvc.yaml")}
    for pod in pod_specs(doc):
        mounts = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
                  if "persistentVolumeClaim" in v}
        assert set(mounts.values()) <= claims
        for c in pod["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            paths = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            if "SPECTUNE_CACHE" in env:
                assert env["SPECTUNE_CACHE"] in paths, "the asset cache must be the mounted volume"
            if "SPECTUNE_RUNS" in env:
                assert not paths[env["SPECTUNE_RUNS"]].get("readOnly"), "runs are written"
            gpu_pod = any("nvidia.com/gpu" in r for r in c.get("resources", {}).values())
            assert c["image"] == ("spectune:gpu" if gpu_pod or doc["metadata"]["name"].endswith("-gpu") else
                                  "spectune:dev"), "GPU pods run the vLLM image, CPU pods the CPU one"


def test_image_pins_torch_as_the_cpu_environment_does():
    dockerfile = (ROOT / "infra" / "docker" / "Dockerfile").read_text()
    assert re.search(r"^torch==[\d.]+$", (ROOT / "constraints" / "cpu.txt").read_text(), flags=re.M)
    assert "pip install -c constraints/cpu.txt torch --index-url https://download.pytorch.org/whl/cpu" in dockerfile
    assert "pip install -c constraints/cpu.txt ." in dockerfile
    assert dockerfile.index("COPY constraints ./constraints") < dockerfile.index("pip install")
    for package in installed_packages():  # every package pyproject installs is in the image
        assert f"COPY {package} ./{package}" in dockerfile, package


def installed_packages() -> list[str]:
    """The top-level packages pyproject.toml's ``packages.find`` includes (a new floor must reach the images)."""
    found = re.search(r"^include = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), flags=re.M)
    names = [n.strip().strip('"').rstrip("*") for n in found.group(1).split(",")]
    assert "sweep" in names and "workers" in names
    return names


def test_gpu_image_installs_vllm_as_the_gpu_constraints_pin_and_declares_the_plugin():
    dockerfile = (ROOT / "infra" / "docker" / "Dockerfile.gpu").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^vllm==0\.33\.\d+$", (ROOT / "constraints" / "gpu.txt").read_text(), flags=re.M)
    assert dockerfile.index("COPY constraints ./constraints") < dockerfile.index("pip install -c constraints/gpu.txt vllm")
    assert dockerfile.index("pip install -c constraints/gpu.txt vllm") < dockerfile.index("pip install -c constraints/gpu.txt .")
    assert "--no-deps" not in dockerfile, "the project's ranges admit vLLM's torch and transformers: no need"
    assert "spectune_rules" in dockerfile and 'spectune_rules = "workers.vllm.plugin:register"' in pyproject
    for package in installed_packages():  # every package pyproject installs is in the image
        assert f"COPY {package} ./{package}" in dockerfile, package


def gpu_manifests() -> list[Path]:
    """Every manifest that runs the GPU image or asks for GPUs."""
    return [p for p in sorted(K8S.glob("*.yaml"))
            if "spectune:gpu" in p.read_text() or "nvidia.com/gpu" in p.read_text()]


def test_no_gpu_manifest_hard_codes_a_cost_ratio():
    names = [p.name for p in gpu_manifests()]
    assert {"raycluster-gpu.yaml", "rayjob-sweep-gpu.yaml", "rayservice-gpu.yaml"} <= set(names)
    for path in gpu_manifests():
        text = path.read_text()
        assert not re.search(r"--cost-ratio[\s=]+['\"]?[\d.]", text), f"{path.name}: c must be measured, not written in"
        assert not re.search(r"cost_ratio\s*[:=]\s*[\d.]", text), path.name


def test_gpu_rayjob_measures_c_through_vllm_on_a_gpu_pod_then_sweeps_with_it():
    from jobs import sweep as sweep_job
    from workers import calibrate

    (job,) = docs("rayjob-sweep-gpu.yaml")
    script = shlex.split(job["spec"]["entrypoint"])[2]
    assert script.startswith("set -euo pipefail;"), "a failed calibration must stop the job"
    steps = entrypoint_steps(job)
    (where,) = [a for a in steps if a[0].startswith("f=")]
    path = where[0].removeprefix("f=")
    assert path.startswith("/runs/") and path.endswith(".json"), "on the runs volume (the asset volume is read-only)"
    # 1) calibrate (unless measured before): its own Ray job, holding one pair actor's GPUs on a GPU pod
    (measure,) = [a for a in steps if "workers.calibrate" in a and "--engine" in a]
    assert measure[:4] == ["test", "-f", "$f", "||"] and measure[4:7] == ["ray", "job", "submit"]
    submit, command = measure[7:measure.index("--")], measure[measure.index("--") + 1:]
    opts = dict(zip(submit[::2], submit[1::2], strict=True))
    assert command[:3] == ["python", "-m", "workers.calibrate"]
    cal = calibrate.build_parser().parse_args(command[3:])
    assert cal.engine == "vllm" and cal.out == "$f"
    # 2) read the figure, 3) sweep with it
    (read,) = [a for a in steps if a[0].startswith("c=$(")]
    assert " ".join(read) == 'c=$(python -m workers.calibrate --print-ratio $f)'
    assert steps.index(measure) < steps.index(read) < steps.index(sweep_argv(job))
    argv = sweep_argv(job)
    assert argv[argv.index("--cost-ratio") + 1] == "$c"
    args = sweep_job.build_parser().parse_args(["0.5" if a == "$c" else a for a in argv[2:]])
    # measured as the sweep runs the pair: same pair, dtype, TP size, vLLM memory and length settings
    assert (cal.pair, cal.dtype, cal.tensor_parallel_size) == (args.pair, args.dtype, args.tensor_parallel_size)
    assert (cal.gpu_memory_utilization, cal.max_model_len) == (args.gpu_memory_utilization, args.max_model_len)
    assert float(opts["--entrypoint-num-gpus"]) == args.gpus_per_actor >= cal.tensor_parallel_size
    assert opts["--address"] == "http://127.0.0.1:8265"  # the driver runs on the head, the dashboard listens there
    (cluster,) = [d for d in docs("raycluster-gpu.yaml") if d["kind"] == "RayCluster"]
    head = cluster["spec"]["headGroupSpec"]
    assert 8265 in [p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]]
    for group in cluster["spec"]["workerGroupSpecs"]:  # a worker pod holds the calibration and writes /runs
        assert quantity(group["rayStartParams"]["num-gpus"]) >= float(opts["--entrypoint-num-gpus"])
        assert quantity(group["rayStartParams"]["num-cpus"]) >= float(opts["--entrypoint-num-cpus"])
        mounts = {m["mountPath"]: m for m in group["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert "/runs" in mounts and not mounts["/runs"].get("readOnly")
    assert "/runs" in {m["mountPath"] for m in head["template"]["spec"]["containers"][0]["volumeMounts"]}


SECRET = ("spectune-api-key", "api-key")  # infra/README.md creates it


def test_the_endpoint_rayjob_certifies_the_rayservices_server_with_flags_the_sweep_accepts():
    from jobs import sweep as sweep_job
    from sweep.settings import parse_settings

    (job,) = docs("rayjob-certify-endpoint.yaml")
    argv = sweep_argv(job)
    settings = parse_settings(sweep_job.build_parser().parse_args(argv[2:]))
    args = settings.args
    assert args.engine == "openai" and args.pair == args.pair_id and args.cost_ratio is not None
    (service,) = [d for d in docs("rayservice.yaml") if d["kind"] == "RayService"]
    assert args.base_url.startswith(f"http://{service['metadata']['name']}-serve-svc:8000/"), "the RayService's server"
    # the service's key: the job's cluster holds it from the same Secret in every pod (its driver and actors send it)
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    assert args.api_key_env == app["args"]["api_key_env"]
    (cluster,) = [d for d in docs("raycluster.yaml") if d["metadata"]["name"] == job["spec"]["clusterSelector"]["ray.io/cluster"]]
    for pod in pod_specs(cluster):
        (var,) = [e for e in pod["containers"][0]["env"] if e["name"] == args.api_key_env]
        assert (var["valueFrom"]["secretKeyRef"]["name"], var["valueFrom"]["secretKeyRef"]["key"]) == SECRET
    assert job["spec"]["runtimeEnvYAML"].count("SPECTUNE_LEDGER: /runs/ledger") == 1


def test_the_server_config_rayjob_certifies_a_fixed_configuration_with_flags_the_sweep_accepts():
    from jobs import sweep as sweep_job
    from sweep.server import levels
    from sweep.settings import parse_settings

    (job,) = docs("rayjob-certify-server-config.yaml")
    argv = sweep_argv(job)
    settings = parse_settings(sweep_job.build_parser().parse_args(argv[2:]))
    args = settings.args
    assert args.engine == "openai" and args.server_config["rejection_sample_method"] == "fly"
    assert args.reference_url and args.reference_url != args.base_url and levels(args) == [16, 1]
    assert args.new_items and args.confirm_items >= 300
    assert job["spec"]["runtimeEnvYAML"].count("SPECTUNE_LEDGER: /runs/ledger") == 1
