"""The KubeRay manifests in deploy/kuberay/, checked against the CRDs in deploy/crds/ and against this repository.

The API server prunes fields a CRD does not define without a word, so a typo (`replica:` for `replicas:`) would be
applied and ignored. These tests close every object schema of the CRDs before validating, so an unknown field fails
here instead. They also check that each RayJob runs an rlhf-ray job on a config of this repository, with overrides
the config accepts and a resource plan its cluster can hold. No cluster is needed; the CRDs load once per session.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import shlex
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "deploy" / "crds"
KUBERAY = ROOT / "deploy" / "kuberay"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
             "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml"}
RAY_KINDS = ("RayCluster", "RayJob")
MONITOR_KINDS = ("PodMonitor", "ServiceMonitor")
EXPECTED = {"raycluster.yaml": "RayCluster", "rayjob-sft.yaml": "RayJob", "rayjob-rm.yaml": "RayJob",
            "rayjob-ppo.yaml": "RayJob", "rayjob-pipeline.yaml": "RayJob"}
SUBCOMMANDS = ("sft", "rm", "ppo", "pipeline")
SHARED = "/mnt/rlhf"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader reads the 1-2 MB CRDs ~10x faster

Schema = dict[str, Any]
Manifest = dict[str, Any]


# --- the validator -----------------------------------------------------------------------------------------------

def strict(schema: Schema) -> Schema:
    """A copy of a CRD schema in plain JSON schema that refuses what the API server would prune.

    Objects with `properties` get `additionalProperties: false` unless they already say what extra keys may hold
    or carry `x-kubernetes-preserve-unknown-fields` (the server keeps unknown fields there, so they are allowed).
    `x-kubernetes-int-or-string` becomes "integer or string" whatever the node said (it may have no type at all),
    and `nullable` also admits null.
    """
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]  # `pattern`, if any, still applies to strings
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    if out.pop("nullable", False):
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def crd_validators(kind: str) -> dict[str, jsonschema.Draft7Validator]:
    """{apiVersion: validator} for every version of one kind's CRD; cached because parsing the YAML is the slow part."""
    crd = yaml.load((CRDS / CRD_FILES[kind]).read_text(), Loader=LOADER)
    assert crd["spec"]["names"]["kind"] == kind
    group = crd["spec"]["group"]
    return {f"{group}/{v['name']}": jsonschema.Draft7Validator(strict(v["schema"]["openAPIV3Schema"]))
            for v in crd["spec"]["versions"]}


def path_of(error: jsonschema.ValidationError) -> str:
    """`spec.workerGroupSpecs.0.replicas`: where in the manifest the error is."""
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def problems(manifest: Manifest) -> list[str]:
    """Every way a RayCluster / RayJob manifest breaks its CRD, one `path: message` line each; [] if it conforms."""
    kind, api = manifest.get("kind"), manifest.get("apiVersion")
    if kind not in CRD_FILES:
        return [f"kind: {kind!r} is not one of {', '.join(CRD_FILES)}"]
    validators = crd_validators(kind)
    if api not in validators:
        return [f"apiVersion: {api!r} is not a version of the {kind} CRD ({', '.join(validators)})"]
    found = [f"{key}: missing" for key in ("metadata", "spec") if key not in manifest]
    if "metadata" in manifest and not manifest["metadata"].get("name"):
        found.append("metadata.name: missing")
    errors = sorted(validators[api].iter_errors(manifest), key=path_of)
    return found + [f"{path_of(e)}: {e.message}" for e in errors]


# --- the manifests -----------------------------------------------------------------------------------------------

def documents(path: Path) -> list[Manifest]:
    """The non-empty YAML documents of a file (a manifest file may hold several)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def ray_manifests(kind: str | None = None, kinds: tuple[str, ...] = RAY_KINDS) -> list[Any]:
    """pytest params of every RayCluster / RayJob document under deploy/kuberay/ (of one kind if given; of
    `kinds` otherwise)."""
    return [pytest.param(doc, id=f"{path.name}:{doc.get('metadata', {}).get('name')}")
            for path in sorted(KUBERAY.glob("*.yaml")) for doc in documents(path)
            if doc.get("kind") in kinds and kind in (None, doc.get("kind"))]


def load(name: str) -> Manifest:
    """The single document of deploy/kuberay/<name>."""
    (doc,) = documents(KUBERAY / name)
    return doc


def cluster_spec(manifest: Manifest) -> Manifest:
    """The RayCluster spec, whether the manifest is a RayCluster or a RayJob that brings its own."""
    return manifest["spec"] if manifest["kind"] == "RayCluster" else manifest["spec"]["rayClusterSpec"]


def pod_specs(manifest: Manifest) -> list[tuple[str, Manifest]]:
    """(group name, pod spec) of the head and of every worker group."""
    spec = cluster_spec(manifest)
    return [("head", spec["headGroupSpec"]["template"]["spec"])] + [
        (g["groupName"], g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]


def quantity(value: int | float | str) -> float:
    """A Kubernetes CPU / GPU count ('16', 8, '500m') as a number."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def ray_nodes(manifest: Manifest) -> list[dict[str, float]]:
    """The nodes Ray would see: one per pod, CPUs and GPUs from rayStartParams, else from the container's limits."""
    spec = cluster_spec(manifest)
    groups = [(spec["headGroupSpec"], 1)] + [(g, g.get("replicas", g["minReplicas"]))
                                              for g in spec.get("workerGroupSpecs", [])]
    nodes = []
    for group, count in groups:
        params = group.get("rayStartParams", {})
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        node = {"CPU": quantity(params.get("num-cpus", limits["cpu"])),
                "GPU": quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))}
        nodes += [dict(node) for _ in range(count)]
    return nodes


def entrypoint_args(job: Manifest) -> Any:
    """The RayJob's entrypoint parsed by rlhf-ray's own command line parser (so unknown flags fail too)."""
    from rlhf_ray.cli import build_parser

    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "rlhf-ray", f"the entrypoint must run rlhf-ray, got {argv[0]!r}"
    assert argv[1] in SUBCOMMANDS, f"rlhf-ray {argv[1]}: expected one of {', '.join(SUBCOMMANDS)}"
    return build_parser().parse_args(argv[1:])


# --- tests: the CRDs and the manifests conform -------------------------------------------------------------------

def test_crds_match_the_checksums_in_their_readme() -> None:
    readme = (CRDS / "README.md").read_text()
    for name in CRD_FILES.values():
        digest = hashlib.sha256((CRDS / name).read_bytes()).hexdigest()
        assert f"{digest}  {name}" in readme, f"{name} changed: update deploy/crds/README.md (see its last section)"


def test_the_expected_manifests_exist() -> None:
    for name, kind in EXPECTED.items():
        assert load(name)["kind"] == kind, name
    assert len(ray_manifests("RayJob")) >= 4


@pytest.mark.parametrize("manifest", ray_manifests())
def test_manifest_conforms_to_its_crd(manifest: Manifest) -> None:
    assert manifest["apiVersion"] == "ray.io/v1"
    assert problems(manifest) == []


def test_pvc_is_a_shared_claim() -> None:
    pvc = load("pvc.yaml")
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    assert pvc["metadata"]["name"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "checkpoints are written from several pods"
    assert re.fullmatch(r"\d+(\.\d+)?([KMGTPE]i?)?", str(pvc["spec"]["resources"]["requests"]["storage"]))


# --- tests: the validator refuses what it should, and only that --------------------------------------------------

def _worker(manifest: Manifest) -> Manifest:
    """The first worker group of a RayCluster manifest."""
    return manifest["spec"]["workerGroupSpecs"][0]


@pytest.mark.parametrize("typo, where", [
    ("rayStartParam", lambda m: m["spec"]["headGroupSpec"]),
    ("replica", _worker),
    ("workerGroupSpec", lambda m: m["spec"]),
    ("volumeMount", lambda m: _worker(m)["template"]["spec"]["containers"][0]),
])
def test_an_unknown_field_is_refused_by_name(typo: str, where: Callable[[Manifest], Manifest]) -> None:
    manifest = copy.deepcopy(load("raycluster.yaml"))
    where(manifest)[typo] = where(manifest).pop(typo + "s")  # the right key, misspelt
    found = problems(manifest)
    assert found and any(f"'{typo}' was unexpected" in p for p in found), found


def test_a_wrong_type_is_refused() -> None:
    manifest = copy.deepcopy(load("raycluster.yaml"))
    _worker(manifest)["replicas"] = "two"
    manifest["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0  # rayStartParams values are strings
    found = problems(manifest)
    assert any(p.startswith("spec.workerGroupSpecs.0.replicas:") and "'two' is not of type 'integer'" in p
               for p in found), found
    assert any(p.startswith("spec.headGroupSpec.rayStartParams.num-gpus:") for p in found), found


def test_a_wrong_api_version_or_kind_is_refused() -> None:
    manifest = copy.deepcopy(load("raycluster.yaml"))
    assert problems({**manifest, "apiVersion": "ray.io/v2"})[0].startswith("apiVersion:")
    assert problems({**manifest, "kind": "RayClusters"})[0].startswith("kind:")
    assert problems({k: v for k, v in manifest.items() if k != "metadata"}) == ["metadata: missing"]


@pytest.mark.parametrize("gpus", [8, "8"])
def test_int_or_string_quantities_take_both(gpus: int | str) -> None:
    manifest = copy.deepcopy(load("raycluster.yaml"))
    _worker(manifest)["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = gpus
    assert problems(manifest) == []


def test_kubernetes_extensions_are_translated() -> None:
    schema = strict({"type": "object", "properties": {
        "port": {"x-kubernetes-int-or-string": True},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                 "properties": {"a": {"type": "string"}}},
        "when": {"type": "string", "nullable": True},
    }})
    valid = jsonschema.Draft7Validator(schema).is_valid
    assert valid({"port": 8080}) and valid({"port": "http"}) and not valid({"port": [1]})
    assert valid({"free": {"a": "x", "anything": {"b": 1}}}) and not valid({"free": {"a": 1}})
    assert valid({"when": None}) and valid({"when": "now"}) and not valid({"when": 1})
    assert not valid({"prot": 8080})


# --- tests: each RayJob runs an rlhf-ray job of this repository --------------------------------------------------

@pytest.mark.parametrize("job", ray_manifests("RayJob"))
def test_entrypoint_runs_a_config_of_this_repository(job: Manifest) -> None:
    args = entrypoint_args(job)
    config = Path(args.config)
    assert not config.is_absolute() and (ROOT / config).is_file(), f"--config {config}: not in the repository"
    assert any(o.startswith(f"output_dir={SHARED}/") for o in args.overrides), \
        f"--set output_dir=... must be on the shared volume ({SHARED}) so a retried job finds its checkpoints"


@pytest.mark.parametrize("job", ray_manifests("RayJob"))
def test_entrypoint_config_loads_and_its_plan_fits_the_cluster(job: Manifest) -> None:
    from rlhf_ray.jobs.preflight import check_datasets, stages as job_stages
    from rlhf_ray.config import ConfigSource, PipelineJob, validate_job
    from rlhf_ray.plan import ResourcePlan

    args = entrypoint_args(job)
    source = ConfigSource.from_file(ROOT / args.config).override(args.overrides)
    config = validate_job(source, expect=args.command)  # as `rlhf-ray <command>` would: kind must match
    for prefix, stage in job_stages(config):
        assert not list(check_datasets(stage)), f"{args.config}: {list(check_datasets(stage))}"
    stages = config.stages() if isinstance(config, PipelineJob) else [config]
    nodes = ray_nodes(job)
    for stage in stages:
        assert ResourcePlan.from_roles(stage.placement_roles()).check_fits(nodes) == [], stage.kind


@pytest.mark.parametrize("recipe, workers", [("llama-8b-8gpu.yaml", 1), ("llama-70b-4node.yaml", 4)])
def test_raycluster_holds_the_multi_gpu_recipes(recipe: str, workers: int) -> None:
    """raycluster.yaml's comment promises the 8B recipe as is and the 70B one with 4 workers."""
    from rlhf_ray.config import load_job
    from rlhf_ray.plan import ResourcePlan

    cluster = copy.deepcopy(load("raycluster.yaml"))
    group = _worker(cluster)
    assert group["minReplicas"] <= workers <= group["maxReplicas"]
    group["replicas"] = workers
    plan = ResourcePlan.from_roles(load_job(ROOT / "configs" / "recipes" / recipe).placement_roles())
    assert plan.check_fits(ray_nodes(cluster)) == []


@pytest.mark.parametrize("job", ray_manifests("RayJob"))
def test_runtime_env_mirrors_deploy_runtime_env(job: Manifest) -> None:
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    reference = yaml.safe_load((ROOT / "deploy" / "runtime_env.yaml").read_text())
    assert "outputs/" in env["excludes"] and any("checkpoints" in e for e in env["excludes"])
    assert env["excludes"] == reference["excludes"] and env["env_vars"] == reference["env_vars"]
    assert env["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"
    assert Path(env["working_dir"]).is_absolute(), "the repository copy inside the image"


@pytest.mark.parametrize("job", ray_manifests("RayJob"))
def test_rayjob_owns_its_cluster_and_is_retried(job: Manifest) -> None:
    spec = job["spec"]
    assert "rayClusterSpec" in spec and "clusterSelector" not in spec
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] > 0
    assert spec["backoffLimit"] >= 1, "a failed job is resubmitted and resumes from its checkpoint"
    assert spec.get("activeDeadlineSeconds", 7 * 86400) >= 86400, "a short deadline kills training runs"


@pytest.mark.parametrize("manifest", ray_manifests())
def test_every_cluster_keeps_token_auth_on(manifest: Manifest) -> None:
    """The head's dashboard listens on the pod IP (the Service and port-forwards reach it there), so every
    request to it, `ray job submit` included, must carry the cluster's token."""
    assert cluster_spec(manifest).get("authOptions", {}).get("mode") == "token"


@pytest.mark.parametrize("manifest", ray_manifests())
def test_every_pod_mounts_the_shared_volume(manifest: Manifest) -> None:
    claim = load("pvc.yaml")["metadata"]["name"]
    head = cluster_spec(manifest)["headGroupSpec"]["rayStartParams"]
    assert head.get("num-gpus") == "0" and head.get("dashboard-host") == "0.0.0.0"
    for group, pod in pod_specs(manifest):
        volumes = {v["name"]: v for v in pod["volumes"]}
        shared = [n for n, v in volumes.items() if v.get("persistentVolumeClaim", {}).get("claimName") == claim]
        assert shared, f"{group}: no volume for the claim {claim}"
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            assert mounts.get(SHARED) in shared, f"{group}/{container['name']}: {claim} not mounted at {SHARED}"
            if "nvidia.com/gpu" in container["resources"]["limits"]:  # NCCL needs a real /dev/shm
                assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", group


# --- monitoring: the Prometheus operator's monitors and the dashboard's settings ---------------------------------

def test_the_monitors_exist_and_conform_to_their_crds() -> None:
    monitors = {doc["kind"]: doc for doc in documents(KUBERAY / "monitoring.yaml")}
    assert set(monitors) == set(MONITOR_KINDS)
    for doc in monitors.values():
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert problems(doc) == []


def test_a_misspelt_monitor_field_is_refused_by_name() -> None:
    (pod_monitor,) = [d for d in documents(KUBERAY / "monitoring.yaml") if d["kind"] == "PodMonitor"]
    broken = copy.deepcopy(pod_monitor)
    broken["spec"]["podMetricsEndpoints"][0]["prot"] = broken["spec"]["podMetricsEndpoints"][0].pop("port")
    assert any(p.startswith("spec.podMetricsEndpoints.0:") and "'prot'" in p for p in problems(broken))


@pytest.mark.parametrize("manifest", ray_manifests())
def test_every_ray_pod_serves_what_the_monitors_scrape(manifest: Manifest) -> None:
    """Each Ray container names the port the monitors scrape, and the worker pods carry the PodMonitor's own
    label (KubeRay adds ray.io/node-type itself)."""
    monitors = {doc["kind"]: doc for doc in documents(KUBERAY / "monitoring.yaml")}
    scraped = {monitors["ServiceMonitor"]["spec"]["endpoints"][0]["port"],
               monitors["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"]}
    wanted = {k: v for k, v in monitors["PodMonitor"]["spec"]["selector"]["matchLabels"].items()
              if not k.startswith("ray.io/")}
    spec = cluster_spec(manifest)
    templates = [("head", spec["headGroupSpec"]["template"])] + [
        (g["groupName"], g["template"]) for g in spec.get("workerGroupSpecs", [])]
    for group, template in templates:
        ports = {p.get("name") for p in template["spec"]["containers"][0].get("ports", [])}
        assert scraped <= ports, f"{group}: no port named {scraped - ports} for Prometheus to scrape"
        if group != "head":
            labels = template.get("metadata", {}).get("labels", {})
            assert wanted.items() <= labels.items(), f"{group}: the PodMonitor selects {wanted}, the pods have {labels}"


@pytest.mark.parametrize("manifest", ray_manifests())
def test_the_head_tells_the_dashboard_where_prometheus_and_grafana_are(manifest: Manifest) -> None:
    head = cluster_spec(manifest)["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in head.get("env", [])}
    for name in ("RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST"):
        assert re.fullmatch(r"https?://[^/\s]+(:\d+)?", env.get(name) or ""), f"{name}: {env.get(name)!r}"


def generation_group(manifest: Manifest) -> Manifest | None:
    """The autoscaling worker group for an elastic pool's extra engines, if the cluster has one."""
    return next((g for g in cluster_spec(manifest).get("workerGroupSpecs", []) if g["groupName"] == "generation"),
                None)


@pytest.mark.parametrize("manifest", [p for p in ray_manifests() if generation_group(p.values[0])])
def test_an_autoscaling_generation_group_has_the_autoscaler_and_starts_empty(manifest: Manifest) -> None:
    group = generation_group(manifest)
    assert cluster_spec(manifest)["enableInTreeAutoscaling"] is True  # else nothing grows the group
    assert group["minReplicas"] == group.get("replicas", 0) == 0 < group["maxReplicas"]


def test_the_elastic_ppo_job_fits_an_extra_engine_per_generation_pod_and_its_extras_in_the_group() -> None:
    """The RayJob asks for engines beyond the recipe's: each takes one pod of the generation group (an engine's
    bundle fits a pod, two do not, so one pod per engine), and the group may grow to as many pods as it asks for."""
    from rlhf_ray.config import ConfigSource, validate_job

    job = load("rayjob-ppo.yaml")
    args = entrypoint_args(job)
    config = validate_job(ConfigSource.from_file(ROOT / args.config).override(args.overrides), expect="ppo")
    placement = config.generation.placement
    assert placement.elastic
    group = generation_group(job)
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    pod = {"CPU": quantity(limits["cpu"]), "GPU": quantity(limits["nvidia.com/gpu"])}
    engine = {"CPU": placement.num_cpus, "GPU": placement.num_gpus}
    assert all(engine[k] <= pod[k] < 2 * engine[k] or engine[k] == 0 for k in engine), (engine, pod)
    assert placement.max_replicas - placement.replicas <= group["maxReplicas"]
