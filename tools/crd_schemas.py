"""Extract the validation schemas of published CustomResourceDefinitions for tests/test_deploy.py.

    python -m tools.crd_schemas --source "kubernetes-sigs/lws v0.10.0" CRD.yaml [...] --out tests/data/crds

Each served version of each CRD becomes `<group>_<plural>_<version>.json.gz`: its `openAPIV3Schema`
exactly as published, less the `description` texts (documentation, not validation), with where it came
from. The tests validate deploy/'s custom resources against these files offline; nothing is fetched when
the tests run. Rerun this on a newer release's CRD files to move to it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os

import yaml


def _strip_descriptions(node):
    if isinstance(node, dict):
        return {k: _strip_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [_strip_descriptions(v) for v in node]
    return node


def extract(path: str, source: str) -> list[tuple[str, dict]]:
    """(file name, record) for every served version of the CRD(s) in `path`."""
    out = []
    with open(path) as f:
        for doc in yaml.safe_load_all(f):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                record = {"source": source, "file": os.path.basename(path), "group": spec["group"],
                          "kind": spec["names"]["kind"], "version": version["name"],
                          "schema": _strip_descriptions(version["schema"]["openAPIV3Schema"])}
                out.append((f"{spec['group']}_{spec['names']['plural']}_{version['name']}.json.gz", record))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("crds", nargs="+", help="CRD YAML files of one release")
    ap.add_argument("--source", required=True, help="where they come from: 'owner/repo tag'")
    ap.add_argument("--out", default="tests/data/crds")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for path in args.crds:
        for name, record in extract(path, args.source):
            with gzip.GzipFile(os.path.join(args.out, name), "wb", mtime=0) as f:
                f.write(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
            print(f"{name}: {record['kind']} {record['version']} from {args.source}")


if __name__ == "__main__":
    main()
