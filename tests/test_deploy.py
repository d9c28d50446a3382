"""The Kubernetes manifests and the Dockerfiles, checked offline.

``deploy/k8s/base`` and ``deploy/k8s/hugepages`` must render (``kubectl kustomize``),
validate strictly against the Kubernetes schemas (kubernetes-validate), wire the
sidecar as docs/how-to/kubernetes.md says, put vllm-router in front with kvxfer's
policy, and pass the misconfiguration scans (checkov on the manifests and the
Dockerfiles, hadolint on the Dockerfiles) with every skipped check justified. Each
tool is first shown a known-bad input, so a tool that checks nothing fails the test.
The tools live in ``.venv-deploy`` (``scripts/setup-deploy-tools.sh``): skipped
without it, unless ``KVXFER_REQUIRE_DEPLOY_TOOLS=1`` (CI).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvxfer.server.config import load_config

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / ".venv-deploy" / "bin"
OVERLAYS = ("base", "hugepages")
#: The oldest Kubernetes with native sidecars on by default.
KUBERNETES = "1.29.0"


@pytest.fixture(scope="module")
def tools() -> Path:
    if not (TOOLS / "kubectl").exists():
        if os.environ.get("KVXFER_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail("KVXFER_REQUIRE_DEPLOY_TOOLS=1 but .venv-deploy is missing")
        pytest.skip("no .venv-deploy (scripts/setup-deploy-tools.sh makes it)")
    return TOOLS


def _run(tool: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=300,
                          input=stdin, env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})


@pytest.fixture(scope="module")
def rendered(tools: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("k8s")
    files = {}
    for overlay in OVERLAYS:
        done = _run(tools / "kubectl", "kustomize", str(REPO / "deploy" / "k8s" / overlay))
        assert done.returncode == 0, done.stderr
        files[overlay] = out / f"{overlay}.yaml"
        files[overlay].write_text(done.stdout)
    return files


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _validate(tools: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return _run(tools / "kubernetes-validate", "--strict", "--quiet", "--no-warn",
                "-k", KUBERNETES, str(path))


def test_the_manifests_validate_against_the_kubernetes_schemas(tools, rendered, tmp_path) -> None:
    docs = _docs(rendered["base"])
    statefulset = next(d for d in docs if d["kind"] == "StatefulSet")
    statefulset["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(statefulset))
    assert _validate(tools, bad).returncode != 0, "the validator accepted an unknown field"
    for overlay, path in rendered.items():
        done = _validate(tools, path)
        assert done.returncode == 0, f"{overlay}: {done.stdout}{done.stderr}"


def test_kvxfer_runs_as_a_native_sidecar_beside_the_engine(rendered) -> None:
    docs = _docs(rendered["base"])
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    [config_map] = by_kind["ConfigMap"]
    config_file = config_map["data"]["kvxfer.yaml"]
    config = load_config(overrides=yaml.safe_load(config_file))  # kvxfer's own validation
    assert config.shm_dir == "/pools" and config.metrics_host == "0.0.0.0"
    peer_port = int(config.peer_address.rsplit(":", 1)[1])

    roles = set()
    for statefulset in by_kind["StatefulSet"]:
        pod = statefulset["spec"]["template"]["spec"]
        [sidecar] = pod["initContainers"]
        [engine] = pod["containers"]
        roles.add(statefulset["spec"]["template"]["metadata"]["labels"]["kvxfer.dev/role"])
        assert sidecar["restartPolicy"] == "Always"  # native: before the engine, after it
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert sidecar[probe]["exec"]["command"][0] == "kvxfer-health", probe
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["pools"]["emptyDir"]["medium"] == "Memory"
        shared = {"pools": "/pools", "sockets": "/run/kvxfer"}
        for container in (sidecar, engine):
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert shared.items() <= mounts.items(), container["name"]
        env = {e["name"]: e.get("value", "") for e in sidecar["env"]}
        assert env["KVXFER_ADVERTISE_ADDRESS"].endswith(f".kvxfer-peers.$(POD_NAMESPACE).svc:{peer_port}")
        assert statefulset["spec"]["serviceName"] == "kvxfer-peers"
        role = statefulset["spec"]["template"]["metadata"]["labels"]["kvxfer.dev/role"]
        assert volumes["tls"]["secret"]["secretName"] == f"kvxfer-{role}-tls"
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        assert f'"kv_role": "{kv_role}"' in engine["env"][0]["value"]
    assert roles == {"prefill", "decode"}

    [service] = [s for s in by_kind["Service"] if s["metadata"]["name"] == "kvxfer-peers"]
    assert service["spec"]["clusterIP"] == "None"
    certificates = {c["spec"]["secretName"]: c["spec"] for c in by_kind["Certificate"]}
    for role in roles:
        cert = certificates[f"kvxfer-{role}-tls"]
        assert cert["commonName"] in config.peer_allow
        assert "*.kvxfer-peers.kvxfer.svc" in cert["dnsNames"]
    [policy] = [p for p in by_kind["NetworkPolicy"] if p["metadata"]["name"] == "kvxfer-peers"]
    peer_rule = policy["spec"]["ingress"][0]
    assert {p["port"] for p in peer_rule["ports"]} == {peer_port, config.ucx_port}
    assert peer_rule["from"][0]["podSelector"]["matchLabels"] == (
        policy["spec"]["podSelector"]["matchLabels"])

    huge = [d for d in _docs(rendered["hugepages"]) if d["kind"] == "StatefulSet"]
    for statefulset in huge:
        pod = statefulset["spec"]["template"]["spec"]
        assert {v["name"]: v for v in pod["volumes"]}["pools"]["emptyDir"] == {"medium": "HugePages-2Mi"}
        assert pod["initContainers"][0]["resources"]["requests"]["hugepages-2Mi"] == "1Gi"


def test_vllm_router_is_in_front_with_kvxfers_policy(rendered) -> None:
    """The router disaggregates (prefill, then decode, passing kv_transfer_params as for
    NixlConnector) over the engines' stable names, with the retry, circuit-breaker and
    health-check flags the tests run it with (``ROUTER_POLICY``); its service selects it,
    and the engines' HTTP port admits the router only."""
    from kvxfer.client.integrations.vllm.router import ROUTER_POLICY

    docs = _docs(rendered["base"])
    [router] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm-router"]
    namespace = router["metadata"]["namespace"]
    [container] = router["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[:1] == ["--vllm-pd-disaggregation"] and args[args.index("--kv-connector") + 1] == "nixl"
    engines = {s["spec"]["template"]["metadata"]["labels"]["kvxfer.dev/role"]: s for s in docs
               if s["kind"] == "StatefulSet"}
    for role, statefulset in engines.items():
        [engine] = statefulset["spec"]["template"]["spec"]["containers"]
        port = next(p["containerPort"] for p in engine["ports"] if p["name"] == "http")
        host = f"{statefulset['metadata']['name']}-0.{statefulset['spec']['serviceName']}.{namespace}.svc"
        assert args[args.index(f"--{role}") + 1] == f"http://{host}:{port}", role
    policy = args[args.index("--policy"):]  # the flags after it: kvxfer's policy
    assert policy == ROUTER_POLICY
    labels = router["spec"]["template"]["metadata"]["labels"]
    [service] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "vllm-router"]
    assert service["spec"]["selector"].items() <= labels.items()
    [engines_policy] = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "kvxfer-peers"]
    http_rules = [r for r in engines_policy["spec"]["ingress"] if {"protocol": "TCP", "port": 8000} in r["ports"]]
    assert [r["from"] for r in http_rules] == [[
        {"podSelector": {"matchLabels": labels}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]]
    probes = container["startupProbe"]
    allowed_s = probes["periodSeconds"] * probes["failureThreshold"]
    assert allowed_s > int(args[args.index("--worker-startup-timeout-secs") + 1])


PRIVILEGED_POD = """
apiVersion: v1
kind: Pod
metadata: {name: bad}
spec:
  containers:
    - name: bad
      image: busybox:latest
      securityContext: {privileged: true}
"""
BAD_DOCKERFILE = "FROM debian\nRUN apt-get update && apt-get install -y curl\n"


@pytest.mark.slow
def test_the_scans_find_no_misconfiguration(tools, rendered, tmp_path) -> None:
    bad_pod, bad_dockerfile = tmp_path / "pod.yaml", tmp_path / "Dockerfile"
    bad_pod.write_text(PRIVILEGED_POD)
    bad_dockerfile.write_text(BAD_DOCKERFILE)
    checkov = [tools / "checkov", "--compact", "--quiet", "--skip-download"]
    assert _run(*checkov, "--framework", "kubernetes", "-f", str(bad_pod)).returncode != 0
    assert _run(tools / "hadolint", str(bad_dockerfile)).returncode != 0

    for overlay, path in rendered.items():
        done = _run(*checkov, "--framework", "kubernetes", "-f", str(path))
        assert done.returncode == 0, f"{overlay}: {done.stdout}"
    for dockerfile in (str(REPO / "docker" / "Dockerfile"), str(REPO / "docker" / "router.Dockerfile")):
        done = _run(*checkov, "--framework", "dockerfile", "-f", dockerfile)
        assert done.returncode == 0, f"{dockerfile}: {done.stdout}"
        done = _run(tools / "hadolint", dockerfile)
        assert done.returncode == 0, f"{dockerfile}: {done.stdout}"
