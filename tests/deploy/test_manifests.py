"""The Kubernetes manifests under deploy/: every kustomize target renders with `kubectl kustomize`,
every resource validates against the Kubernetes schemas (kubernetes-validate), and the rendered
overlays carry the security and operational settings tokensvc relies on.

Custom resources (CloudNativePG, cert-manager, SPIRE) have no schema in kubernetes-validate; each of
those kinds gets a structural check here instead, and a kind with neither fails.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.rendering import (
    OVERLAYS,
    ROOT,
    TARGETS,
    all_containers,
    by_kind,
    one,
    render,
    string_values,
)
from tokensvc.embedders.registry import load_embedders
from tokensvc.settings import Settings
from tokensvc.settings_sources import ENV_PREFIX, load_settings

Resource = dict[str, Any]

# The oldest Kubernetes the manifests support (native sidecars are on by default from 1.29) and the
# newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
SETTING_NAMES = {field.name for field in dataclasses.fields(Settings)}
SERVER = "tokensvc"


# --- rendering and schemas ------------------------------------------------------------------------


def _check_cnpg_cluster(resource: Resource) -> None:
    spec = resource["spec"]
    assert isinstance(spec["instances"], int)
    assert spec["instances"] >= 1
    assert isinstance(spec["imageName"], str)
    assert ":" in spec["imageName"]
    initdb = spec["bootstrap"]["initdb"]
    assert {"database", "owner", "secret", "postInitApplicationSQL"} <= set(initdb)
    assert all(isinstance(statement, str) for statement in initdb["postInitApplicationSQL"])
    assert isinstance(spec["storage"]["size"], str)
    for role in spec.get("managed", {}).get("roles", []):
        assert set(role) <= {
            "name",
            "ensure",
            "login",
            "inherit",
            "createrole",
            "inRoles",
            "passwordSecret",
            "comment",
        }
        assert isinstance(role["passwordSecret"]["name"], str)


def _check_cnpg_scheduled_backup(resource: Resource) -> None:
    spec = resource["spec"]
    assert len(spec["schedule"].split()) == 6, "CloudNativePG schedules are cron with seconds"
    assert spec["cluster"]["name"]


def _check_certificate(resource: Resource) -> None:
    spec = resource["spec"]
    assert spec["secretName"]
    assert {"name", "kind"} <= set(spec["issuerRef"])
    assert spec.get("uris") or spec.get("dnsNames") or spec.get("commonName")


def _check_issuer(resource: Resource) -> None:
    spec = resource["spec"]
    assert len(set(spec) & {"selfSigned", "ca", "acme", "vault", "venafi"}) == 1


def _check_cluster_spiffe_id(resource: Resource) -> None:
    spec = resource["spec"]
    assert spec["spiffeIDTemplate"].startswith("spiffe://")
    assert spec["podSelector"]["matchLabels"]
    assert "namespace" not in resource["metadata"], "ClusterSPIFFEID is cluster-scoped"


def _check_service_monitor(resource: Resource) -> None:
    spec = resource["spec"]
    assert spec["selector"]["matchLabels"]
    assert spec["endpoints"]
    for endpoint in spec["endpoints"]:
        assert isinstance(endpoint["port"], str), "endpoints name the Service port"
        assert endpoint.get("path", "/metrics").startswith("/")


def _check_prometheus_rule(resource: Resource) -> None:
    groups = resource["spec"]["groups"]
    assert groups
    for group in groups:
        assert isinstance(group["name"], str)
        for rule in group["rules"]:
            assert len({"record", "alert"} & set(rule)) == 1, rule
            assert isinstance(rule["expr"], str)
            assert set(rule) <= {"record", "alert", "expr", "for", "labels", "annotations"}, rule


# Custom resources kubernetes-validate has no schema for: (apiVersion, kind) -> structural check.
CUSTOM_RESOURCE_CHECKS = {
    ("postgresql.cnpg.io/v1", "Cluster"): _check_cnpg_cluster,
    ("postgresql.cnpg.io/v1", "ScheduledBackup"): _check_cnpg_scheduled_backup,
    ("cert-manager.io/v1", "Certificate"): _check_certificate,
    ("cert-manager.io/v1", "Issuer"): _check_issuer,
    ("spire.spiffe.io/v1alpha1", "ClusterSPIFFEID"): _check_cluster_spiffe_id,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _check_service_monitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): _check_prometheus_rule,
}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_kustomize_target_renders(target: str) -> None:
    resources = render(target)
    assert resources
    for resource in resources:
        assert resource["apiVersion"]
        assert resource["kind"]
        assert resource["metadata"]["name"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_resource_validates_against_the_kubernetes_schemas(target: str, version: str) -> None:
    for resource in render(target):
        name = f"{resource['kind']}/{resource['metadata']['name']} in {target}"
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            check = CUSTOM_RESOURCE_CHECKS.get((resource["apiVersion"], resource["kind"]))
            assert check is not None, f"{name}: no Kubernetes schema and no structural check"
            check(resource)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} is invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}")


def test_namespaced_resources_land_in_the_tokensvc_namespace() -> None:
    for overlay in OVERLAYS:
        for resource in render(overlay):
            if resource["kind"] not in {"Namespace", "ClusterSPIFFEID"}:
                assert resource["metadata"].get("namespace") == "tokensvc", resource["metadata"]["name"]


# --- the Deployment -------------------------------------------------------------------------------


def _deployment(overlay: str) -> Resource:
    return one(render(overlay), "Deployment", SERVER)


def _server_container(overlay: str) -> dict[str, Any]:
    containers = _deployment(overlay)["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == SERVER)


def _settings_data(overlay: str) -> dict[str, str]:
    data: dict[str, str] = one(render(overlay), "ConfigMap", "tokensvc-settings")["data"]
    return data


def _assert_hardened(pod_spec: dict[str, Any], where: str) -> None:
    pod_security = pod_spec["securityContext"]
    assert pod_security["runAsNonRoot"] is True, where
    assert pod_security["runAsUser"] == 10001, where
    assert pod_security["seccompProfile"]["type"] == "RuntimeDefault", where
    assert pod_spec["automountServiceAccountToken"] is False, where
    # A Service named tokensvc would inject TOKENSVC_SERVICE_HOST etc., which Settings rejects.
    assert pod_spec["enableServiceLinks"] is False, where
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod_spec), where
    for container in all_containers(pod_spec):
        context = container["securityContext"]
        name = f"{where}: container {container['name']}"
        assert context["runAsNonRoot"] is True, name
        assert context.get("runAsUser", pod_security["runAsUser"]) != 0, name
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context.get("privileged", False) is False, name
        assert context["capabilities"]["drop"] == ["ALL"], name
        assert "add" not in context["capabilities"], name
        assert context["seccompProfile"]["type"] == "RuntimeDefault", name
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), f"{name}: {kind}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_runs_two_or_more_hardened_replicas(overlay: str) -> None:
    deployment = _deployment(overlay)
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    _assert_hardened(deployment["spec"]["template"]["spec"], f"{overlay} Deployment")
    assert _server_container(overlay)["args"] == ["serve"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_root_filesystem_is_read_only_with_tmp_as_an_empty_dir(overlay: str) -> None:
    pod = _deployment(overlay)["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in _server_container(overlay)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert PurePosixPath(_settings_data(overlay)["TOKENSVC_STATE_DIR"]).is_relative_to("/tmp")


def _probe_command(probe: dict[str, Any]) -> str:
    return " ".join(probe["exec"]["command"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_call_tokensvc_health_over_mtls_with_the_workload_certificate(overlay: str) -> None:
    container = _server_container(overlay)
    settings = _settings_data(overlay)
    port = settings["TOKENSVC_LISTEN_ADDRESS"].rpartition(":")[2]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        assert "exec" in probe, f"{kind}: the native gRPC probe cannot present a client certificate"
        assert "grpc" not in probe, kind
        command = _probe_command(probe)
        assert "tokensvc health" in command, kind
        assert f"--ca {settings['TOKENSVC_TLS_CLIENT_CA_FILE']}" in command, kind
        assert f"--cert {settings['TOKENSVC_TLS_CERT_FILE']}" in command, kind
        assert f"--key {settings['TOKENSVC_TLS_KEY_FILE']}" in command, kind
        assert f"--target localhost:{port}" in command, kind
        assert "--timeout 2" in command, kind
        assert probe["timeoutSeconds"] > 2, kind
    # Readiness requires SERVING (the exit code of `tokensvc health`).
    assert container["readinessProbe"]["exec"]["command"][:2] == ["tokensvc", "health"]


def test_liveness_accepts_serving_and_not_serving_but_not_an_unreachable_server(tmp_path: Path) -> None:
    command = _probe_command(_server_container("prod")["livenessProbe"])
    match = re.search(r"grep -Eq '([^']+)'", command)
    assert match is not None
    assert "--json" in command
    alive = re.compile(match.group(1))
    assert alive.search(json.dumps({"target": "localhost:50051", "status": "SERVING"}))
    assert alive.search(json.dumps({"target": "localhost:50051", "status": "NOT_SERVING"}))
    # What `tokensvc health --json` really prints for a server that does not answer.
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (tmp_path / name).write_text("not a certificate\n")
    files = [
        f"--{flag}={tmp_path / name}"
        for flag, name in (("ca", "ca.crt"), ("cert", "tls.crt"), ("key", "tls.key"))
    ]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokensvc",
            "health",
            "--json",
            "--target",
            "127.0.0.1:9",
            "--timeout",
            "2",
            *files,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    printed = json.loads(result.stdout)
    assert printed["status"].startswith("UNREACHABLE")
    assert not alive.search(result.stdout)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prestop_sleeps_and_the_grace_period_covers_the_drain(overlay: str) -> None:
    pod = _deployment(overlay)["spec"]["template"]["spec"]
    command = _server_container(overlay)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    sleep = re.fullmatch(r"sleep (\d+)", command[2])
    assert sleep is not None
    drain = float(_settings_data(overlay)["TOKENSVC_SHUTDOWN_GRACE_SECONDS"])
    assert pod["terminationGracePeriodSeconds"] > int(sleep.group(1)) + drain


# --- secrets: files only, never inline ------------------------------------------------------------

SECRET_FILE_SETTINGS = {
    "TOKENSVC_DATABASE_CREDENTIAL_DIR": "tokensvc-db-app",
    "TOKENSVC_DATABASE_ROTATOR_CREDENTIAL_DIR": "tokensvc-db-rotator",
    "TOKENSVC_DATABASE_RUNNER_CREDENTIAL_DIR": "tokensvc-db-runner",
    "TOKENSVC_TRUST_BUNDLE_FILE": "tokensvc-trust-bundle",
    "TOKENSVC_PEPPER_DIR": "tokensvc-peppers",
}
EXPECTED_PATHS = {
    "TOKENSVC_DATABASE_CREDENTIAL_DIR": "/var/run/secrets/tokensvc/db-app",
    "TOKENSVC_DATABASE_ROTATOR_CREDENTIAL_DIR": "/var/run/secrets/tokensvc/db-rotator",
    "TOKENSVC_DATABASE_RUNNER_CREDENTIAL_DIR": "/var/run/secrets/tokensvc/db-runner",
    "TOKENSVC_TRUST_BUNDLE_FILE": "/var/run/secrets/tokensvc/trust/trust-bundle.jwks",
    "TOKENSVC_PEPPER_DIR": "/var/run/secrets/tokensvc/peppers",
}


def _volume_for(overlay: str, path: str) -> dict[str, Any]:
    """The volume the server container sees at `path` (the longest mount prefix)."""
    pod = _deployment(overlay)["spec"]["template"]["spec"]
    mounts = [
        m
        for m in _server_container(overlay)["volumeMounts"]
        if PurePosixPath(path).is_relative_to(m["mountPath"])
    ]
    assert mounts, f"{path} is not on any volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volume: dict[str, Any] = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return volume


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_mounted_as_files_at_the_paths_the_settings_name(overlay: str) -> None:
    settings = _settings_data(overlay)
    for setting, secret in SECRET_FILE_SETTINGS.items():
        assert settings[setting] == EXPECTED_PATHS[setting]
        volume = _volume_for(overlay, settings[setting])
        assert volume["secret"]["secretName"] == secret, setting
    # The embedder's API key: a Secret file named by the embedders TOML from the ConfigMap.
    embedders = tomllib.loads(
        one(render(overlay), "ConfigMap", "tokensvc-embedders")["data"]["embedders.toml"]
    )
    key_file = embedders["embedders"]["e5"]["api_key_file"]
    assert key_file == "/var/run/secrets/tokensvc/embedder/api-key"
    assert _volume_for(overlay, key_file)["secret"]["secretName"] == "tokensvc-embedder"
    assert "configMap" in _volume_for(overlay, settings["TOKENSVC_EMBEDDERS_FILE"])


def test_workload_certificate_comes_from_spiffe_in_prod_and_cert_manager_in_dev() -> None:
    prod_pod = _deployment("prod")["spec"]["template"]["spec"]
    tls_dir = str(PurePosixPath(_settings_data("prod")["TOKENSVC_TLS_CERT_FILE"]).parent)
    assert any(v.get("csi", {}).get("driver") == "csi.spiffe.io" for v in prod_pod["volumes"])
    helper = next(c for c in prod_pod["initContainers"] if c["name"] == "spiffe-helper")
    assert helper["restartPolicy"] == "Always"
    assert "startupProbe" in helper
    assert any(m["mountPath"] == tls_dir for m in helper["volumeMounts"])
    conf = one(render("prod"), "ConfigMap", "tokensvc-spiffe-helper")["data"]["helper.conf"]
    assert f'cert_dir = "{tls_dir}"' in conf
    for key, setting in (
        ("svid_file_name", "TOKENSVC_TLS_CERT_FILE"),
        ("svid_key_file_name", "TOKENSVC_TLS_KEY_FILE"),
        ("svid_bundle_file_name", "TOKENSVC_TLS_CLIENT_CA_FILE"),
    ):
        assert f'{key} = "{PurePosixPath(_settings_data("prod")[setting]).name}"' in conf
    spiffe_id = one(render("prod"), "ClusterSPIFFEID", SERVER)["spec"]
    assert "localhost" in spiffe_id["dnsNameTemplates"], "the exec probes dial localhost"

    dev_pod = _deployment("dev")["spec"]["template"]["spec"]
    assert not dev_pod.get("initContainers")
    assert not any("csi" in v for v in dev_pod["volumes"])
    certificate = one(render("dev"), "Certificate", "tokensvc-tls")["spec"]
    assert (
        _volume_for("dev", _settings_data("dev")["TOKENSVC_TLS_CERT_FILE"])["secret"]["secretName"]
        == (certificate["secretName"])
    )
    assert {"server auth", "client auth"} <= set(certificate["usages"])
    assert certificate["uris"] == ["spiffe://dev.local/ns/tokensvc/sa/tokensvc"]
    assert "localhost" in certificate["dnsNames"]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_no_secret_value_is_inline_in_the_rendered_output(target: str) -> None:
    resources = render(target)
    assert not by_kind(resources, "Secret"), "Secrets are created out of band, never rendered"
    for resource in resources:
        for text in string_values(resource):
            assert not re.search(r"PRIVATE KEY|BEGIN CERTIFICATE", text), resource["metadata"]["name"]
            assert not re.search(r"PASSWORD\s+'", text, re.IGNORECASE), resource["metadata"]["name"]
        for pod in _pod_specs(resource):
            for container in all_containers(pod):
                for env in container.get("env", []):
                    assert "secretKeyRef" not in env.get("valueFrom", {}), f"{env['name']}: secrets are files"
                for source in container.get("envFrom", []):
                    assert "secretRef" not in source, "secrets are files, never environment variables"


def _pod_specs(resource: Resource) -> list[dict[str, Any]]:
    if resource["kind"] in {"Deployment", "Job"}:
        return [resource["spec"]["template"]["spec"]]
    return []


# --- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", [*OVERLAYS, "base"])
def test_configmap_names_only_real_settings_and_is_a_valid_configuration(
    overlay: str, tmp_path: Path
) -> None:
    data = _settings_data(overlay)
    for key in data:
        assert key.startswith(ENV_PREFIX), key
        assert key[len(ENV_PREFIX) :].lower() in SETTING_NAMES, f"{key} is not a tokensvc setting"
    settings = load_settings(environ=data)
    assert settings.listen_address == "0.0.0.0:50051"
    assert settings.database_dsn == "postgresql://tokensvc-db-rw:5432/tokensvc"
    assert settings.admin_spiffe_ids
    assert settings.control_plane_spiffe_ids
    assert all(i.startswith(f"spiffe://{settings.trust_domain}/") for i in settings.admin_spiffe_ids)
    assert all(i.startswith(f"spiffe://{settings.trust_domain}/") for i in settings.control_plane_spiffe_ids)
    assert settings.migrate_on_start is False
    # The embedders file loads (with the API key path pointed at a stand-in file).
    embedders_toml = one(render(overlay), "ConfigMap", "tokensvc-embedders")["data"]["embedders.toml"]
    (tmp_path / "api-key").write_text("stand-in\n")
    local = tmp_path / "embedders.toml"
    local.write_text(
        embedders_toml.replace("/var/run/secrets/tokensvc/embedder/api-key", str(tmp_path / "api-key"))
    )
    registry = load_embedders(local)
    assert settings.memory_embedder in registry


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_take_settings_from_the_rendered_configmap_and_ports_agree(overlay: str) -> None:
    resources = render(overlay)
    configmap_name = one(resources, "ConfigMap", "tokensvc-settings")["metadata"]["name"]
    container = _server_container(overlay)
    assert container["envFrom"] == [{"configMapRef": {"name": configmap_name}}]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    data = _settings_data(overlay)
    assert ports["grpc"] == int(data["TOKENSVC_LISTEN_ADDRESS"].rpartition(":")[2])
    if "TOKENSVC_METRICS_ADDRESS" in data:
        assert ports["metrics"] == int(data["TOKENSVC_METRICS_ADDRESS"].rpartition(":")[2])
    job = one(resources, "Job", "tokensvc-migrate")["spec"]["template"]["spec"]
    for env in job["containers"][0]["env"]:
        assert env["name"][len(ENV_PREFIX) :].lower() in SETTING_NAMES, env["name"]
        if "configMapKeyRef" in env.get("valueFrom", {}):
            assert env["valueFrom"]["configMapKeyRef"]["name"] == configmap_name


# --- service, availability, network ---------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_pdb_and_hpa_select_the_server_pods(overlay: str) -> None:
    resources = render(overlay)
    labels = _deployment(overlay)["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, str]) -> bool:
        return bool(selector) and selector.items() <= labels.items()

    service = one(resources, "Service", SERVER)["spec"]
    assert service["type"] == "ClusterIP"
    assert selects(service["selector"])
    assert {(p["name"], p["port"]) for p in service["ports"]} == {("grpc", 50051), ("metrics", 9464)}
    pdb = one(resources, "PodDisruptionBudget", SERVER)["spec"]
    assert pdb["minAvailable"] >= 1
    assert selects(pdb["selector"]["matchLabels"])
    assert pdb["minAvailable"] < _deployment(overlay)["spec"]["replicas"]
    hpa = one(resources, "HorizontalPodAutoscaler", SERVER)["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": SERVER}
    assert hpa["minReplicas"] >= 2
    assert hpa["maxReplicas"] > hpa["minReplicas"]
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_account_has_no_automounted_token(overlay: str) -> None:
    accounts = by_kind(render(overlay), "ServiceAccount")
    assert {a["metadata"]["name"] for a in accounts} == {"tokensvc", "tokensvc-migrate"}
    assert all(a["automountServiceAccountToken"] is False for a in accounts)
    assert _deployment(overlay)["spec"]["template"]["spec"]["serviceAccountName"] == "tokensvc"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy_admits_only_launchers_the_control_plane_and_admins(overlay: str) -> None:
    policy = one(render(overlay), "NetworkPolicy", SERVER)["spec"]
    labels = _deployment(overlay)["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    by_port = {rule["ports"][0]["port"]: rule for rule in policy["ingress"]}
    assert set(by_port) == {50051, 9464}
    assert all(len(rule["ports"]) == 1 for rule in policy["ingress"])
    grpc_peers = by_port[50051]["from"]
    assert {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"ctxmesh.ai/role": "launcher"}},
    } in grpc_peers
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ctxmesh-system"}}
    } in grpc_peers
    assert {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"ctxmesh.ai/role": "tokensvc-admin"}},
    } in grpc_peers
    assert len(grpc_peers) == 3
    assert by_port[9464]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    egress_ports = {(p["port"], p["protocol"]) for rule in policy["egress"] for p in rule["ports"]}
    assert egress_ports == {(5432, "TCP"), (53, "UDP"), (53, "TCP"), (8080, "TCP")}
    database = next(r for r in policy["egress"] if r["ports"][0]["port"] == 5432)
    assert database["to"] == [{"podSelector": {"matchLabels": {"cnpg.io/cluster": "tokensvc-db"}}}]


# --- database: CloudNativePG and the schema migration Job ------------------------------------------------


def _roles_in_operations_doc() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    block = text.split("## Database roles", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.startswith("tokensvc_")]


@pytest.mark.parametrize(("overlay", "instances"), [("dev", 1), ("prod", 3)])
def test_cnpg_cluster_has_pgvector_and_the_documented_roles(overlay: str, instances: int) -> None:
    resources = render(overlay)
    cluster = one(resources, "Cluster", "tokensvc-db")["spec"]
    assert cluster["instances"] == instances
    assert re.fullmatch(
        r"ghcr\.io/cloudnative-pg/postgresql:1[5-9][-.\w]*-(system|standard)-\w+(@sha256:\w+)?",
        cluster["imageName"],
    )
    initdb = cluster["bootstrap"]["initdb"]
    assert initdb["database"] == "tokensvc"
    sql = initdb["postInitApplicationSQL"]
    assert "CREATE EXTENSION IF NOT EXISTS vector" in sql
    roles = _roles_in_operations_doc()
    assert roles[0] == "tokensvc_owner" == initdb["owner"]
    for role in roles[1:]:
        assert any(s.startswith(f"CREATE ROLE {role} ") for s in sql), f"{role} is not created"
    assert (
        "GRANT tokensvc_app_a, tokensvc_app_b, tokensvc_runner_a, tokensvc_runner_b TO tokensvc_rotator "
        "WITH ADMIN TRUE, INHERIT FALSE, SET FALSE" in sql
    )
    assert "GRANT CONNECT ON DATABASE tokensvc TO tokensvc_app, tokensvc_runner, tokensvc_rotator" in sql
    for login in ("tokensvc_app_a", "tokensvc_app_b", "tokensvc_runner_a", "tokensvc_runner_b"):
        assert f"ALTER ROLE {login} SET track_activities = off" in sql
    # The passwords CloudNativePG sets are the Secrets tokensvc mounts.
    managed = {r["name"]: r for r in cluster["managed"]["roles"]}
    assert (
        managed["tokensvc_app_a"]["passwordSecret"]["name"]
        == SECRET_FILE_SETTINGS["TOKENSVC_DATABASE_CREDENTIAL_DIR"]
    )
    assert (
        managed["tokensvc_rotator"]["passwordSecret"]["name"]
        == SECRET_FILE_SETTINGS["TOKENSVC_DATABASE_ROTATOR_CREDENTIAL_DIR"]
    )
    assert (
        managed["tokensvc_runner_a"]["passwordSecret"]["name"]
        == SECRET_FILE_SETTINGS["TOKENSVC_DATABASE_RUNNER_CREDENTIAL_DIR"]
    )
    assert managed["tokensvc_runner_a"]["inRoles"] == ["tokensvc_runner"]
    # The rotator administers both pairs of alternating login roles (ROTATE of either credential).
    assert sorted(managed["tokensvc_rotator"]["inRoles"]) == [
        "tokensvc_app_a",
        "tokensvc_app_b",
        "tokensvc_runner_a",
        "tokensvc_runner_b",
    ]
    # The DSN's host is the cluster's read-write Service.
    host = _settings_data(overlay)["TOKENSVC_DATABASE_DSN"].split("//", 1)[1].split(":", 1)[0]
    assert host == f"{one(resources, 'Cluster', 'tokensvc-db')['metadata']['name']}-rw"


def test_backups_go_to_an_object_store_in_prod_and_are_off_in_dev() -> None:
    prod = render("prod")
    store = one(prod, "Cluster", "tokensvc-db")["spec"]["backup"]["barmanObjectStore"]
    assert store["destinationPath"].startswith("s3://")
    assert store["s3Credentials"]["accessKeyId"]["name"] == "tokensvc-db-backup-s3"
    assert one(prod, "ScheduledBackup", "tokensvc-db-daily")["spec"]["cluster"]["name"] == "tokensvc-db"
    dev = render("dev")
    assert "backup" not in one(dev, "Cluster", "tokensvc-db")["spec"]
    assert not by_kind(dev, "ScheduledBackup")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_migration_job_runs_tokensvc_migrate_as_the_schema_owner(overlay: str) -> None:
    resources = render(overlay)
    job = one(resources, "Job", "tokensvc-migrate")
    pod = job["spec"]["template"]["spec"]
    _assert_hardened(pod, f"{overlay} schema migration Job")
    (container,) = pod["containers"]
    assert container["image"] == _server_container(overlay)["image"]
    assert container["args"][0] == "migrate"
    env = {e["name"]: e for e in container["env"]}
    owner_dir = env["TOKENSVC_DATABASE_OWNER_CREDENTIAL_DIR"]["value"]
    volume = next(v for v in pod["volumes"] if v["name"] == _mount_name(container, owner_dir))
    owner_secret = one(resources, "Cluster", "tokensvc-db")["spec"]["bootstrap"]["initdb"]["secret"]["name"]
    assert volume["secret"]["secretName"] == owner_secret
    mounted_secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert mounted_secrets == {owner_secret}, "the Job holds the owner credential and nothing else"


def _mount_name(container: dict[str, Any], path: str) -> str:
    return str(next(m["name"] for m in container["volumeMounts"] if m["mountPath"] == path))


# --- the dev overlay is explained ---------------------------------------------------------------


def test_docs_explain_every_secret_image_and_setting_the_dev_overlay_references() -> None:
    doc = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    resources = render("dev")
    secrets: set[str] = set()
    images: set[str] = set()
    for resource in resources:
        for pod in _pod_specs(resource):
            secrets |= {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
            images |= {c["image"] for c in all_containers(pod)}
    cluster = one(resources, "Cluster", "tokensvc-db")["spec"]
    secrets.add(cluster["bootstrap"]["initdb"]["secret"]["name"])
    secrets |= {r["passwordSecret"]["name"] for r in cluster["managed"]["roles"]}
    secrets |= {c["spec"]["secretName"] for c in by_kind(resources, "Certificate")}
    images.add(cluster["imageName"])
    for name in sorted(secrets | images | set(_settings_data("dev"))):
        assert f"`{name}`" in doc, f"docs/scaling.md does not explain `{name}`"
