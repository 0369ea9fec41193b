"""The manifests in deploy/: every document validates against the Kubernetes schema of its kind
(kubernetes-validate's bundled OpenAPI schemas, strict: unknown fields fail), the custom resources
(LeaderWorkerSet, InferencePool, HTTPRoute) against their published CRDs' schemas (tests/data/crds, from
the projects' release tags by tools/crd_schemas.py: strict structure, and their CEL rules where cel-python
can judge them) with their pod templates also as Kubernetes PodTemplates, and every jaxcb command in them
parses with jaxcb's own CLI and plans (`jaxcb plan`) on the device memory the manifest names. The endpoint
picker's metric specs (its configuration's engineConfigs) name metrics a real server exports with the types
the model-server protocol asks for (check_epp_metrics, run on tests/test_routing.py's servers)."""

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

CRDS = os.path.join(ROOT, "tests", "data", "crds")


def _strict(node: dict, in_branch: bool = False) -> dict:
    """A CRD's structural schema as JSON Schema, as the API server applies it with strict field validation
    (`kubectl apply`'s default): an object's unknown fields fail unless it preserves them, int-or-string
    takes either, nullable takes null. Inside anyOf/allOf/oneOf/not (value checks, which repeat fields
    the structure declares) no unknown-field rule is added."""
    out = dict(node)
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [_strict(n, True) for n in node[key]]
    if "not" in node:
        out["not"] = _strict(node["not"], True)
    if "properties" in node:
        out["properties"] = {k: _strict(v, in_branch) for k, v in node["properties"].items()}
    if isinstance(node.get("items"), dict):
        out["items"] = _strict(node["items"], in_branch)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(node["additionalProperties"], in_branch)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [*out.get("anyOf", []), {"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (not in_branch and node.get("type") == "object" and "properties" in node
            and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _load_crds() -> dict:
    """(apiVersion, kind) -> the published CRD version's record (tools/crd_schemas.py made the files)."""
    import gzip
    import json

    crds = {}
    for path in sorted(glob.glob(os.path.join(CRDS, "*.json.gz"))):
        with gzip.open(path) as f:
            record = json.load(f)
        crds[(f"{record['group']}/{record['version']}", record["kind"])] = record
    return crds


CRD_RECORDS = _load_crds()


def _child_schema(schema: dict, key: str) -> dict | None:
    """The schema of field `key` of an object: its own property, else the additionalProperties schema."""
    child = schema.get("properties", {}).get(key)
    if child is None and isinstance(schema.get("additionalProperties"), dict):
        child = schema["additionalProperties"]
    return child


def _cel_rules(value, schema: dict, path: str):
    """(path, rule, value) for every x-kubernetes-validations rule that applies to a value in `value`."""
    for rule in schema.get("x-kubernetes-validations", ()):
        yield path, rule, value
    if isinstance(value, dict):
        for key, sub in value.items():
            child = _child_schema(schema, key)
            if child is not None:
                yield from _cel_rules(sub, child, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            yield from _cel_rules(sub, schema["items"], f"{path}[{i}]")


def _with_defaults(value, schema: dict):
    """`value` with the schema's defaults filled in, as the API server does before it validates."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out = {k: v for k, v in value.items()}
        for key, child in props.items():
            if key not in out and "default" in child:
                out[key] = child["default"]
        for key, sub in out.items():
            child = _child_schema(schema, key)
            if child is not None:
                out[key] = _with_defaults(sub, child)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_with_defaults(v, schema["items"]) for v in value]
    return value


_VALIDATORS: dict = {}
_PROGRAMS: dict = {}


def _validator(record: dict):
    """The strict schema's validator, made once per CRD version (the LWS schema holds two pod templates)."""
    key = (record["group"], record["kind"], record["version"])
    if key not in _VALIDATORS:
        schema = _strict(record["schema"])
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
        _VALIDATORS[key] = cls(schema)
    return _VALIDATORS[key]


def _program(rule: str):
    """The CEL rule compiled once (None where cel-python cannot compile it)."""
    import celpy

    if rule not in _PROGRAMS:
        env = celpy.Environment()
        try:
            _PROGRAMS[rule] = env.program(env.compile(rule))
        except Exception:  # noqa: BLE001 - a Kubernetes-only function or syntax: not judged here
            _PROGRAMS[rule] = None
    return _PROGRAMS[rule]


def _validate_crd(doc: dict, record: dict) -> tuple[int, int]:
    """Validate a custom resource against its published schema: the structure strictly (jsonschema), then
    each CEL rule on the values it applies to (cel-python), after filling in the schema's defaults as the
    API server does. A rule that uses a Kubernetes-only CEL function, or a transition rule on oldSelf,
    cannot be judged offline and is counted, not passed. Returns (rules evaluated, rules not evaluable);
    a rule that evaluates false raises."""
    import celpy

    doc = _with_defaults(doc, record["schema"])
    error = jsonschema.exceptions.best_match(_validator(record).iter_errors(doc))
    if error is not None:
        raise error
    done, skipped = 0, 0
    for path, rule, value in _cel_rules(doc, record["schema"], doc["kind"]):
        program = None if "oldSelf" in rule["rule"] else _program(rule["rule"])
        if program is None:
            skipped += 1
            continue
        try:
            result = program.evaluate({"self": celpy.json_to_cel(value)})
        except Exception:  # noqa: BLE001 - a function celpy lacks (isURL, quantity, ...): not judged here
            skipped += 1
            continue
        if not isinstance(result, celpy.celtypes.BoolType):
            skipped += 1
            continue
        if not result:
            raise jsonschema.ValidationError(f"{path}: {rule.get('message', rule['rule'])} ({rule['rule']})")
        done += 1
    return done, skipped


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
    kinds, count, rules = set(), 0, [0, 0]
    for name, doc in _documents():
        count += 1
        kinds.add(doc["kind"])
        record = CRD_RECORDS.get((doc["apiVersion"], doc["kind"]))
        if record is None:
            _validate_builtin(doc)
            continue
        done, skipped = _validate_crd(doc, record)
        rules[0] += done
        rules[1] += skipped
        for template, where in _pod_templates(doc):  # the pods a custom resource makes: Kubernetes' own schema
            _validate_builtin({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                               "template": template})
    print(f"\n{count} manifests validated, kinds: {sorted(kinds)}; CRD rules evaluated {rules[0]}, "
          f"not evaluable offline {rules[1]}")
    assert rules[0] > 0
    assert {"Deployment", "Service", "LeaderWorkerSet", "InferencePool", "HTTPRoute", "ConfigMap"} <= kinds
    # strict validation is strict: a misspelt field fails
    import kubernetes_validate

    bad = next(doc for _, doc in _documents() if doc["kind"] == "Deployment")
    bad = {**bad, "spec": {**bad["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_builtin(bad)


def _first(kind: str) -> dict:
    import copy

    return copy.deepcopy(next(doc for _, doc in _documents() if doc["kind"] == kind))


def test_the_published_crd_schemas_catch_mistakes():
    """The CRD files are the real schemas, applied strictly: a misspelt field, a wrong type or enum, and a
    broken CEL rule each fail, in each custom kind."""
    assert {k for _, k in CRD_RECORDS} >= {"LeaderWorkerSet", "InferencePool", "HTTPRoute"}
    cases = []
    lws = _first("LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["sise"] = 2
    cases.append(("LeaderWorkerSet", lws))
    lws = _first("LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    cases.append(("LeaderWorkerSet", lws))
    lws = _first("LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagee"] = "x"
    cases.append(("LeaderWorkerSet", lws))
    pool = _first("InferencePool")
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]  # CEL: port numbers unique
    cases.append(("InferencePool", pool))
    pool = _first("InferencePool")
    pool["spec"]["endpointPickerRef"].pop("port")  # CEL: a Service needs a port
    cases.append(("InferencePool", pool))
    pool = _first("InferencePool")
    pool["spec"]["targetPorts"] = [{"number": "8000"}]
    cases.append(("InferencePool", pool))
    route = _first("HTTPRoute")
    route["spec"]["rules"][0]["backendRefs"][0]["weight"] = -1
    cases.append(("HTTPRoute", route))
    route = _first("HTTPRoute")
    route["spec"]["rule"] = route["spec"].pop("rules")
    cases.append(("HTTPRoute", route))
    for kind, doc in cases:
        with pytest.raises(jsonschema.ValidationError):
            _validate_crd(doc, CRD_RECORDS[(doc["apiVersion"], kind)])
    for kind in ("LeaderWorkerSet", "InferencePool", "HTTPRoute"):  # and the untouched documents pass
        doc = _first(kind)
        _validate_crd(doc, CRD_RECORDS[(doc["apiVersion"], kind)])


def _expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: ENV[m.group(1)], arg)


def _jaxcb_containers():
    for name, doc in _documents():
        for template, where in _pod_templates(doc):
            for c in template["spec"]["containers"]:
                if c["image"].startswith(IMAGE):
                    yield where, template, c


def test_the_commands_in_the_manifests_are_jaxcbs_own_and_plan(capsys):
    """Each jaxcb container's arguments parse with jaxcb's CLI, and `jaxcb plan` with its model,
    parallelism and the device memory the manifest names fits the model."""
    from jaxcb.cli import build_parser
    from jaxcb.cli.commands import main

    seen = 0
    for where, template, container in _jaxcb_containers():
        args = [_expand(a) for a in container["args"]]
        parsed = build_parser().parse_args(args)
        assert parsed.command == "serve", where
        memory = template["metadata"]["annotations"]["jaxcb.dev/device-memory"]
        devices = sum(int(v) for k, v in container["resources"]["limits"].items() if k.endswith(("gpu", "tpu")))
        tensor = parsed.tensor_parallel or (devices * parsed.num_processes if parsed.num_processes else 1)
        plan = ["plan", "--model", parsed.model, "--memory", memory, "--tensor-parallel", str(tensor)]
        assert main(plan) == 0, (where, capsys.readouterr().err)  # in this process: the CLI's own entry
        out = capsys.readouterr().out
        assert "largest batch" in out, out
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


SPECS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec")


def _epp_metric_specs() -> dict[str, str]:
    """The metrics the endpoint picker reads from jaxcb: its configuration's core-metrics-extractor entry for
    the pool's engine (EPP v1.4 and later refuse the old --*-metric flags, and need the data layer's
    source and extractor named in `data.sources`)."""
    for _, doc in _documents():
        for template, _ in _pod_templates(doc):
            for c in template["spec"]["containers"]:
                if "/epp:" not in c["image"]:
                    continue
                major, minor = (int(x) for x in re.search(r":v(\d+)\.(\d+)", c["image"]).groups())
                assert (major, minor) >= (1, 4), c["image"]
                assert not [a for a in c["args"] if a.startswith("--") and a.split("=")[0].endswith("-metric")]
                mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/config")
                volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
                assert c["args"][c["args"].index("--config-file") + 1] == "/config/config.yaml"
                config_map = next(d for _, d in _documents()
                                  if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
                config = yaml.safe_load(config_map["data"]["config.yaml"])
                plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
                (source,) = config["data"]["sources"]
                assert plugins[source["pluginRef"]]["type"] == "metrics-data-source"
                (extractor,) = source["extractors"]
                parameters = plugins[extractor["pluginRef"]]["parameters"]
                assert plugins[extractor["pluginRef"]]["type"] == "core-metrics-extractor"
                engine = next(e for e in parameters["engineConfigs"] if e["name"] == parameters["defaultEngine"])
                for profile in config["schedulingProfiles"]:
                    assert all(p["pluginRef"] in plugins for p in profile["plugins"])
                return {spec: engine[spec] for spec in SPECS}
    raise AssertionError("no endpoint picker in deploy/")


def check_epp_metrics(text: str) -> None:
    """A server's /metrics (its HTTP port, where the picker scrapes) holds each metric the picker's
    configuration names, as a gauge with the protocol's meaning (tests/test_routing.py checks its servers with it; they
    run with --max-loras 1)."""
    from prometheus_client.parser import text_string_to_metric_families

    specs = _epp_metric_specs()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for spec, metric in specs.items():
        assert metric in families, (spec, metric)
        assert families[metric].type == "gauge", (spec, metric, families[metric].type)
    value = {f: families[m].samples[0].value for f, m in specs.items() if families[m].samples}
    assert value["queuedRequestsSpec"] == 0 and value["runningRequestsSpec"] == 0
    assert 0 <= value["kvUsageSpec"] <= 1
    (cache,) = families[specs["cacheInfoSpec"]].samples
    assert cache.labels["block_size"] == "16" and int(cache.labels["num_gpu_blocks"]) > 0
    (lora,) = families[specs["loraSpec"]].samples
    assert set(lora.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert lora.labels["max_lora"] == "1"


def test_each_file_applies_alone_and_leaves_lws_its_own_service():
    """Every volume claim a file's pods use is declared in that file (each manifest applies alone), and no
    Service takes a LeaderWorkerSet's name: LWS makes the headless Service of that name that its pods'
    LWS_LEADER_ADDRESS resolves through, and makes none if the name is taken."""
    files: dict[str, list[dict]] = {}
    for name, doc in _documents():
        files.setdefault(name, []).append(doc)
    for name, docs in files.items():
        declared = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
        for doc in docs:
            for template, where in _pod_templates(doc):
                for volume in template["spec"].get("volumes", ()):
                    if "persistentVolumeClaim" in volume:
                        assert volume["persistentVolumeClaim"]["claimName"] in declared, (name, where)
    services = {d["metadata"]["name"] for _, d in _documents() if d["kind"] == "Service"}
    sets = [d["metadata"]["name"] for _, d in _documents() if d["kind"] == "LeaderWorkerSet"]
    assert sets and not services & set(sets)
    assert all(ENV["LWS_LEADER_ADDRESS"].split(".")[1] == s for s in sets)  # (what LWS puts there: its name)
