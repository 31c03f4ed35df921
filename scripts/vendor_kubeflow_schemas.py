"""Regenerate tests/data/kubeflow-trainer-v2.3.0/ (the schemas tests/unit/test_k8s.py validates
the `bpslaunch k8s --kubeflow` manifests against).

Source: the Kubeflow Trainer v2.3.0 API as published on PyPI, ``kubeflow-trainer-api==2.3.0``
(the models Kubeflow Trainer generates from its OpenAPI document, api/openapi-spec/swagger.json
of kubeflow/trainer, the same Go types its CRDs manifests/base/crds/
trainer.kubeflow.org_{trainjobs,clustertrainingruntimes}.yaml are generated from; they include
the JobSet jobset.x-k8s.io/v1alpha2 types and the Kubernetes core types the runtime's JobSet
template embeds). Not needed to run the tests, only to regenerate::

    pip download --no-deps kubeflow-trainer-api==2.3.0 -d /tmp/kf
    unzip -q /tmp/kf/kubeflow_trainer_api-2.3.0-py3-none-any.whl -d /tmp/kf/x
    PYTHONPATH=/tmp/kf/x python scripts/vendor_kubeflow_schemas.py

What is kept of each model: its field names (the JSON names), their types, the required ones,
and the enumerations its validators check; descriptions go. Every object is closed
(``additionalProperties: false``): an unknown field is an error, as ``kubectl apply`` (strict
field validation) makes it. Optional fields accept no ``null`` (the manifests write none).
"""
from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

RELEASE = "2.3.0"
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / f"kubeflow-trainer-v{RELEASE}"
KINDS = {"TrainJob": "trainer_v1alpha1_train_job.TrainerV1alpha1TrainJob",
         "ClusterTrainingRuntime":
             "trainer_v1alpha1_cluster_training_runtime.TrainerV1alpha1ClusterTrainingRuntime"}
_VALIDATOR = re.compile(r"@field_validator\('(\w+)'\)\s+def \w+\(cls, value\):(.*?)raise ValueError",
                        re.S)
_ENUM = re.compile(r"set\(\[(.*?)\]\)", re.S)


def _enums(model: type) -> dict[str, list[str]]:
    """JSON field name -> the values the model's validator allows."""
    out = {}
    source = inspect.getsource(model)
    for field, body in _VALIDATOR.findall(source):
        m = _ENUM.search(body)
        if m:
            alias = model.model_fields[field].alias or field
            out[alias] = [json.loads(v.strip().replace("'", '"'))
                          for v in m.group(1).split(",") if v.strip()]
    return out


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        node = {k: _strip(v) for k, v in node.items()
                if k not in ("description", "title", "default")}
        alts = node.get("anyOf")
        if alts is not None:
            alts = [a for a in alts if a != {"type": "null"}]
            node.pop("anyOf")
            if len(alts) == 1:
                node.update(alts[0])
            else:
                node["anyOf"] = alts
        return node
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def schema(kind: str, dotted: str) -> dict[str, Any]:
    module, _, name = dotted.rpartition(".")
    models = importlib.import_module("kubeflow_trainer_api.models")
    model = getattr(importlib.import_module(f"kubeflow_trainer_api.models.{module}"), name)
    raw = model.model_json_schema(by_alias=True)
    defs = raw.pop("$defs")
    defs[name] = raw
    for def_name in list(defs):
        d = _strip(defs[def_name])
        props = d.get("properties", {})
        if "actual_instance" in props and "one_of_schemas" in props:  # Quantity, IntOrString
            d = {"anyOf": props["actual_instance"]["anyOf"]}
        elif d.get("type") == "object" and "properties" in d:
            d["additionalProperties"] = False
            cls = getattr(models, def_name, None)
            for field, values in (_enums(cls) if cls is not None else {}).items():
                target = props[field]
                (target["items"] if target.get("type") == "array" else target)["enum"] = values
        defs[def_name] = d
    top = defs.pop(name)
    top["properties"]["apiVersion"] = {"const": "trainer.kubeflow.org/v1alpha1"}
    top["properties"]["kind"] = {"const": kind}
    top["required"] = sorted(set(top.get("required", [])) | {"apiVersion", "kind", "metadata",
                                                               "spec"})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$comment": f"{kind} of Kubeflow Trainer v{RELEASE} (trainer.kubeflow.org/v1alpha1, "
                        f"with jobset.x-k8s.io/v1alpha2 and Kubernetes core types), from "
                        f"PyPI kubeflow-trainer-api=={RELEASE}: "
                        "scripts/vendor_kubeflow_schemas.py",
            **top, "$defs": dict(sorted(defs.items()))}


def main() -> int:
    version = importlib.import_module("kubeflow_trainer_api").__version__
    if version != RELEASE:
        print(f"kubeflow_trainer_api {version} found, {RELEASE} expected", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    for kind, dotted in KINDS.items():
        path = OUT / f"{kind.lower()}.schema.json"
        path.write_text(json.dumps(schema(kind, dotted), indent=1, sort_keys=False) + "\n")
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
