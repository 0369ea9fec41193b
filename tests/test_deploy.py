"""The manifests in deploy/: every document validates against the Kubernetes schema of its kind
(kubernetes-validate's bundled OpenAPI schemas, strict: unknown fields fail), the custom resources
(LeaderWorkerSet, InferencePool, HTTPRoute) against the required structure of their published CRDs with
their pod templates as Kubernetes PodTemplates, and every jaxcb command in them parses with jaxcb's own
CLI and plans (`jaxcb plan`) on the device memory the manifest names. The endpoint picker's metric flags
name metrics a real server exports with the types the model-server protocol asks for (check_epp_metrics,
run on tests/test_routing.py's servers)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import jsonschema
import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
K8S_VERSION = "1.33.0"
IMAGE = "ghcr.io/jaxcb/jaxcb"
# A sample of what Kubernetes puts in $(VAR) (LWS's env, the downward API) when it starts the container.
ENV = {"LWS_LEADER_ADDRESS": "jaxcb-multihost-0.jaxcb-multihost.default", "LWS_GROUP_SIZE": "2",
       "LWS_WORKER_INDEX": "1", "NAMESPACE": "default"}

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
# The required structure of the custom resources' published schemas (v1 of each), written out here.
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): {
        "type": "object", "required": ["spec"], "properties": {"spec": {
            "type": "object", "required": ["selector", "targetPorts", "endpointPickerRef"], "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                             "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                            "additionalProperties": {"type": "string", "maxLength": 63}}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                "endpointPickerRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                      "properties": {"name": _NAME, "group": {"type": "string"},
                                                     "kind": {"type": "string"}, "port": _PORT,
                                                     "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}}},
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): {
        "type": "object", "required": ["spec"], "properties": {"spec": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "parentRefs": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "rules": {"type": "array", "maxItems": 16, "items": {
                    "type": "object", "properties": {
                        "matches": {"type": "array"},
                        "backendRefs": {"type": "array", "items": {
                            "type": "object", "required": ["name"],
                            "properties": {"name": _NAME, "group": {"type": "string"}, "kind": {"type": "string"},
                                           "port": {"type": "integer"}, "weight": {"type": "integer"}}}}}}}}}}},
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): {
        "type": "object", "required": ["spec"], "properties": {"spec": {
            "type": "object", "required": ["leaderWorkerTemplate"], "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {"type": "object"}, "networkConfig": {"type": "object"},
                "leaderWorkerTemplate": {
                    "type": "object", "required": ["workerTemplate"], "additionalProperties": False,
                    "properties": {"size": {"type": "integer", "minimum": 1},
                                   "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                                   "leaderTemplate": {"type": "object"}, "workerTemplate": {"type": "object"},
                                   "subGroupPolicy": {"type": "object"}}}}}}},
}


def _documents():
    for path in sorted(glob.glob(os.path.join(DEPLOY, "*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc is not None:
                    yield os.path.basename(path), doc


def _validate_builtin(doc: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _pod_templates(doc: dict):
    """(template, where) of every pod template a workload holds."""
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        yield spec["template"], doc["metadata"]["name"]
    if doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            if key in lwt:
                yield lwt[key], f"{doc['metadata']['name']}.{key}"


def test_every_manifest_validates_against_its_kinds_schema():
    kinds, count = set(), 0
    for name, doc in _documents():
        count += 1
        kinds.add(doc["kind"])
        schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if schema is None:
            _validate_builtin(doc)
            continue
        jsonschema.validate(doc, schema)
        for template, where in _pod_templates(doc):  # the pods a custom resource makes: Kubernetes' own schema
            _validate_builtin({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                               "template": template})
    print(f"\n{count} manifests validated, kinds: {sorted(kinds)}")
    assert {"Deployment", "Service", "LeaderWorkerSet", "InferencePool", "HTTPRoute", "ConfigMap"} <= kinds
    # strict validation is strict: a misspelt field fails
    import kubernetes_validate

    bad = next(doc for _, doc in _documents() if doc["kind"] == "Deployment")
    bad = {**bad, "spec": {**bad["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_builtin(bad)


def _expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: ENV[m.group(1)], arg)


def _jaxcb_containers():
    for name, doc in _documents():
        for template, where in _pod_templates(doc):
            for c in template["spec"]["containers"]:
                if c["image"].startswith(IMAGE):
                    yield where, template, c


def test_the_commands_in_the_manifests_are_jaxcbs_own_and_plan():
    """Each jaxcb container's arguments parse with jaxcb's CLI, and `jaxcb plan` with its model,
    parallelism and the device memory the manifest names fits the model."""
    from jaxcb.cli import build_parser

    seen = 0
    for where, template, container in _jaxcb_containers():
        args = [_expand(a) for a in container["args"]]
        parsed = build_parser().parse_args(args)
        assert parsed.command == "serve", where
        memory = template["metadata"]["annotations"]["jaxcb.dev/device-memory"]
        devices = sum(int(v) for k, v in container["resources"]["limits"].items() if k.endswith(("gpu", "tpu")))
        tensor = parsed.tensor_parallel or (devices * parsed.num_processes if parsed.num_processes else 1)
        plan = [sys.executable, "-m", "jaxcb", "plan", "--model", parsed.model, "--memory", memory,
                "--tensor-parallel", str(tensor)]
        done = subprocess.run(plan, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, (where, done.stderr)
        assert "largest batch" in done.stdout, done.stdout
        if parsed.num_processes:  # multi-host: the group's pods x devices are the mesh
            assert int(parsed.num_processes) == 2 and 0 <= int(parsed.process_id) < 2
        seen += 1
    assert seen >= 4


def test_the_images_entry_command_runs(tmp_path):
    """The Dockerfile's ENTRYPOINT and CMD are jaxcb's: `jaxcb --help` and `jaxcb serve --help` run,
    and the CMD's serve arguments parse."""
    import json

    from jaxcb.cli import build_parser

    text = open(os.path.join(DEPLOY, "Dockerfile")).read()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert entry == ["jaxcb"] and cmd[0] == "serve"
    assert build_parser().parse_args(cmd).http_port == 8000
    for argv in (["--help"], ["serve", "--help"]):
        done = subprocess.run([sys.executable, "-m", "jaxcb", *argv], capture_output=True, text=True, timeout=60,
                              cwd=ROOT)
        assert done.returncode == 0 and "usage: jaxcb" in done.stdout, done.stderr
    assert re.search(r'pip install --no-cache-dir -e "\.\[\$\{EXTRA\}\]"', text)  # cuda12 or tpu, as built


def _epp_metric_flags() -> dict[str, str]:
    for _, doc in _documents():
        for template, _ in _pod_templates(doc):
            for c in template["spec"]["containers"]:
                if "/epp:" in c["image"]:
                    args = c["args"]
                    return {a[2:]: args[i + 1] for i, a in enumerate(args) if a.endswith("-metric")}
    raise AssertionError("no endpoint picker in deploy/")


def check_epp_metrics(text: str) -> None:
    """A server's /metrics (its HTTP port, where the picker scrapes) holds each metric the picker's flags
    name, as a gauge with the protocol's meaning (tests/test_routing.py checks its servers with it; they
    run with --max-loras 1)."""
    from prometheus_client.parser import text_string_to_metric_families

    flags = _epp_metric_flags()
    assert set(flags) == {"total-queued-requests-metric", "total-running-requests-metric",
                          "kv-cache-usage-percentage-metric", "lora-info-metric", "cache-info-metric"}
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for flag, metric in flags.items():
        assert metric in families, (flag, metric)
        assert families[metric].type == "gauge", (flag, metric, families[metric].type)
    value = {f: families[m].samples[0].value for f, m in flags.items() if families[m].samples}
    assert value["total-queued-requests-metric"] == 0 and value["total-running-requests-metric"] == 0
    assert 0 <= value["kv-cache-usage-percentage-metric"] <= 1
    (cache,) = families[flags["cache-info-metric"]].samples
    assert cache.labels["block_size"] == "16" and int(cache.labels["num_gpu_blocks"]) > 0
    (lora,) = families[flags["lora-info-metric"]].samples
    assert set(lora.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert lora.labels["max_lora"] == "1"
