"""docs/DEPLOYING.md's KubeRay blocks, run as far as this machine can: the manifest against our Ray pin, the
image's pip line against the packaging extras, and the connection lines through bash and the hook's own
reading of a connection. (No Kubernetes here: `kubectl` is a shell function that prints a token.)"""

from __future__ import annotations

import base64
import json
import re
import shlex
import subprocess
from pathlib import Path

import tomllib
import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "DEPLOYING.md"


def block(marker: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    found = re.search(
        rf"<!-- run: tests/unit/test_deploying_doc.py {re.escape(marker)} -->\n```\w+\n(.*?)```", text, re.DOTALL
    )
    assert found, f"docs/DEPLOYING.md has no block marked {marker!r}"
    return found.group(1)


def extras() -> dict[str, list[str]]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def flattened(names: list[str]) -> set[str]:
    """The requirements of some extras, with our own `airflow-provider-rayllm[...]` expanded."""
    table, out = extras(), set()
    for name in names:
        for line in table[name]:
            req = Requirement(line)
            if req.name == "airflow-provider-rayllm":
                out |= flattened(sorted(req.extras))
            else:
                out.add(str(req))
    return out


def ray_pin() -> str:
    (ray,) = [Requirement(r) for r in extras()["cluster"] if Requirement(r).name == "ray"]
    lower = [s.version for s in ray.specifier if s.operator == ">="]
    return ".".join(lower[0].split(".")[:2])


def test_the_raycluster_manifest_runs_our_ray_with_token_auth():
    manifest = yaml.safe_load(block("raycluster"))
    assert manifest["kind"] == "RayCluster"
    spec = manifest["spec"]
    assert spec["rayVersion"].startswith(ray_pin() + "."), (spec["rayVersion"], ray_pin())
    assert spec["authOptions"]["mode"] == "token"
    workers = spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" in workers["resources"]["limits"]


def test_the_images_pip_line_is_the_cluster_and_gpu_extras():
    words = shlex.split(block("cluster-image").replace("\\\n", " "))
    listed = {str(Requirement(w)) for w in words[words.index("install") + 1 :]}
    assert listed == flattened(["cluster", "gpu"])


def test_the_kuberay_connection_lines_give_the_hook_the_dashboard_and_the_token():
    from airflow.sdk import Connection

    from airflow_provider_rayllm.hooks.ray_job import RayConnSettings

    token = "canary-token-7f3a"
    fake_kubectl = f"kubectl() {{ echo {base64.b64encode(token.encode()).decode()}; }}\n"
    script = fake_kubectl + block("kuberay-connection") + 'printf %s "$AIRFLOW_CONN_RAY_DEFAULT"\n'
    value = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    body = json.loads(value)
    conn = Connection(
        conn_id="ray_default",
        conn_type=body["conn_type"],
        host=body["host"],
        password=body["password"],
        extra=json.dumps(body["extra"]),
    )
    settings = RayConnSettings.from_connection(conn)
    assert settings.address == "http://rayllm-head-svc.default.svc:8265"
    assert settings.token == token
    assert settings.output_base == "s3://my-bucket/llm"
