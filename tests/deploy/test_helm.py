"""The Helm chart through the real helm binary: lint, render with every value set, Kubernetes schema
validation, refusal of bad values; then the rendered objects read back and checked for what matters."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "epdserve"
GOOD_VALUES = [None, *sorted((CHART / "ci").glob("*.yaml"))]
BAD_VALUES = sorted((Path(__file__).parent / "values").glob("bad-*.yaml"))
KUBE_VERSION = "1.30.0"
ROLE_LABEL = "app.kubernetes.io/component"


def value_id(path):
    return "defaults" if path is None else path.stem


def of_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def by_name(objects, kind):
    return {o["metadata"]["name"]: o for o in of_kind(objects, kind)}


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def main_container(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def served(parse_cli):
    """served(deployment) -> (parsed args, {port: name}) of the role's container: its command line read
    by the real CLI parser, and the container ports it declares."""

    def read(deployment):
        container = main_container(deployment)
        args = parse_cli(container["command"] + container["args"])
        return args, {p["containerPort"]: p["name"] for p in container["ports"]}

    return read


def listening_ports(args) -> dict[str, int]:
    """What the process binds, by the name the chart gives each port."""
    if args.role == "proxy":
        return {"http": args.port, "inbox": args.inbox_port}
    ports = {"control": args.port, "http": args.http_port}
    if args.data_port:
        ports["data"] = args.data_port
    return ports


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_lint_strict(helm, values):
    done = helm("lint", "--strict", CHART, *(["-f", values] if values else []))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_renders_valid_kubernetes_objects(render, validate, values):
    manifest, objects = render(values)
    done = validate("kubernetes-validate", "--strict", "--quiet", "-k", KUBE_VERSION, "-", input=manifest)
    assert done.returncode == 0, done.stdout + done.stderr
    # Only the optional CRD may go unchecked: every built-in kind has a schema.
    unchecked = [line for line in done.stdout.splitlines() if "Couldn't find schema" in line]
    assert all("ServiceMonitor" in line for line in unchecked), unchecked
    assert {"Deployment", "Service", "ConfigMap", "Pod"} <= {o["kind"] for o in objects}


def test_kubernetes_validate_refuses_an_unknown_field(render, validate):
    # --strict is what catches a misspelt field, which Kubernetes itself would drop without a word.
    manifest, _ = render(None)
    line = "            readOnlyRootFilesystem: true\n"
    broken = manifest.replace(line, line + "            readOnlyRootFileSystem: true\n", 1)
    assert broken != manifest
    done = validate("kubernetes-validate", "--strict", "--quiet", "-k", KUBE_VERSION, "-", input=broken)
    assert done.returncode != 0 and "readOnlyRootFileSystem" in done.stdout, done.stdout


@pytest.mark.parametrize("values", BAD_VALUES, ids=value_id)
def test_bad_values_are_refused_by_the_schema(helm, values):
    done = helm("template", "rel", CHART, "-f", values)
    assert done.returncode != 0
    assert "schema" in done.stderr, done.stderr


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_probes_hit_the_ports_each_process_listens_on(render, served, values):
    for deployment in of_kind(render(values)[1], "Deployment"):
        args, declared = served(deployment)
        listening = listening_ports(args)
        assert sorted(declared.items()) == sorted((port, name) for name, port in listening.items()), \
            f"{deployment['metadata']['name']}: declared {declared}, listening {listening}"
        container = main_container(deployment)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["port"] == "http" and listening["http"] in declared, (deployment["metadata"]["name"], probe)
            assert get["path"] in ("/health", "/ready")
        # /health answers only once the model is loaded: the startup budget must cover loading.
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_proxy_discovers_each_role_through_its_headless_service(render, served, values):
    objects = render(values)[1]
    deployments = {d["metadata"]["labels"][ROLE_LABEL]: d for d in of_kind(objects, "Deployment")}
    services = by_name(objects, "Service")
    proxy, _ = served(deployments.pop("proxy"))
    targets = {"encoder": proxy.encoder, "prefill": proxy.prefill, "decode": proxy.decode}
    assert {role for role, t in targets.items() if t} == set(deployments), "every engine role, and only those"
    for role, deployment in deployments.items():
        (target,) = targets[role]
        host, port = target.rsplit(":", 1)
        service = services[host]  # a short name resolves in the release's namespace
        assert service["spec"]["clusterIP"] == "None", f"{host} must resolve to every pod"
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(service["spec"]["selector"], pod_labels), f"{host} does not select the {role} pods"
        (control,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        args, declared = served(deployment)
        assert declared[args.port] == control["targetPort"], f"{target} does not reach {role}'s --port"


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_engines_advertise_their_pod_ip(render, served, values):
    # Pod names do not resolve in cluster DNS, so the default (the hostname) would be unreachable.
    for deployment in of_kind(render(values)[1], "Deployment"):
        args, _ = served(deployment)
        assert args.host == "0.0.0.0" and args.advertise_host == "$(POD_IP)"
        env = {e["name"]: e for e in main_container(deployment)["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_services_route_to_declared_container_ports(render, values):
    objects = render(values)[1]
    pods = [d["spec"]["template"] for d in of_kind(objects, "Deployment")]
    for service in of_kind(objects, "Service"):
        (pod,) = [p for p in pods if selects(service["spec"]["selector"], p["metadata"]["labels"])]
        names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, (service["metadata"]["name"], port)


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_nothing_runs_as_root_or_writes_its_image(render, values):
    for obj in of_kind(render(values)[1], "Deployment") + of_kind(render(values)[1], "Pod"):
        spec = obj["spec"]["template"]["spec"] if obj["kind"] == "Deployment" else obj["spec"]
        pod_context = spec["securityContext"]
        assert pod_context["runAsNonRoot"] is True and pod_context["runAsUser"] != 0
        assert pod_context["seccompProfile"]["type"] == "RuntimeDefault"
        assert spec["automountServiceAccountToken"] is False
        writable = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
            assert context["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert mounts["/tmp"]["name"] in writable, "caches need a writable /tmp"
            if "/models" in mounts and container["name"] != "model":
                assert mounts["/models"]["readOnly"] is True  # only the init container writes the model


def test_gpu_values_ask_for_gpus_and_run_cuda(render, served):
    objects = render(CHART / "ci" / "gpu-values.yaml")[1]
    for deployment in of_kind(objects, "Deployment"):
        args, _ = served(deployment)
        limits = main_container(deployment)["resources"]["limits"]
        pod = deployment["spec"]["template"]["spec"]
        if args.role in ("prefill", "decode"):
            assert limits["nvidia.com/gpu"] == 1 and args.device == "cuda" and args.dtype == "bfloat16"
            assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        else:
            assert "nvidia.com/gpu" not in limits and "nodeSelector" not in pod
        volume = next(v for v in pod["volumes"] if v["name"] == "models")
        assert volume["persistentVolumeClaim"] == {"claimName": "llava-weights", "readOnly": True}
        assert args.model == "/models/llava-1.5-7b-hf"


def test_xpyd_values_scale_each_role_and_drop_the_encoder(render, served, parse_cli):
    objects = render(CHART / "ci" / "xpyd-values.yaml")[1]
    deployments = {d["metadata"]["labels"][ROLE_LABEL]: d for d in of_kind(objects, "Deployment")}
    assert set(deployments) == {"prefill", "decode", "proxy"}
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in of_kind(objects, "HorizontalPodAutoscaler")}
    for role in ("prefill", "decode"):
        deployment = deployments[role]
        name = deployment["metadata"]["name"]
        assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
        assert hpas[name]["spec"]["minReplicas"] == 2
        (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
        assert parse_cli(init["command"]).which == "smollm2"
        args, _ = served(deployment)
        assert args.model == "/models/models/SmolLM2-135M-Instruct" and args.curve_dir == "/etc/epdserve/curve"
    assert deployments["proxy"]["spec"]["replicas"] == 2
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        matched = [r for r, d in deployments.items()
                   if selects(pdb["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])]
        assert len(matched) == 1 and pdb["spec"]["maxUnavailable"] == 1


def test_ingress_monitoring_values_protect_the_api(render, served):
    objects = render(CHART / "ci" / "ingress-monitoring-values.yaml")[1]
    services = by_name(objects, "Service")
    (ingress,) = of_kind(objects, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    proxy_service = services[backend["name"]]
    assert proxy_service["spec"].get("clusterIP") != "None", "an ingress needs a Service with an address"
    assert backend["port"]["name"] in {p["name"] for p in proxy_service["spec"]["ports"]}
    for deployment in of_kind(objects, "Deployment"):
        args, _ = served(deployment)
        env = {e["name"]: e for e in main_container(deployment)["env"]}
        if args.role == "proxy":
            assert env["EPDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "epdserve-api-key",
                                                                             "key": "api-key"}
            assert args.served_model_name == "llava-demo"
        else:
            assert "EPDSERVE_API_KEY" not in env
    (monitor,) = of_kind(objects, "ServiceMonitor")
    scraped = [s for s in services.values() if selects(monitor["spec"]["selector"]["matchLabels"],
                                                       s["metadata"]["labels"])]
    assert {s["metadata"]["labels"][ROLE_LABEL] for s in scraped} == {"encoder", "prefill", "decode", "proxy"}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in scraped)
    assert endpoint["authorization"]["credentials"]["name"] == "epdserve-api-key"


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_helm_test_pod_sends_a_chat_completion_through_the_proxy(render, values):
    objects = render(values)[1]
    (pod,) = of_kind(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-c"]
    assert container["args"] == [(CHART / "files" / "chat_test.py").read_text()]
    env = {e["name"]: e for e in container["env"]}
    url = env["EPDSERVE_URL"]["value"]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    proxy = by_name(objects, "Service")[host]
    assert proxy["metadata"]["labels"][ROLE_LABEL] == "proxy" and int(port) == proxy["spec"]["ports"][0]["port"]
    proxy_env = {e["name"] for d in of_kind(objects, "Deployment") for e in main_container(d)["env"]}
    assert ("EPDSERVE_API_KEY" in env) == ("EPDSERVE_API_KEY" in proxy_env)


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_notes_tell_how_to_reach_the_api(helm, render, values):
    done = helm("install", "epdserve", CHART, "-n", "llm", "--dry-run=client", *(["-f", values] if values else []))
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("\nNOTES:\n", 1)[1]
    objects = render(values)[1]
    ingresses = of_kind(objects, "Ingress")
    if ingresses:
        assert f"https://{ingresses[0]['spec']['rules'][0]['host']}/v1/chat/completions" in notes
    else:
        # The README's port-forward line is the one the chart prints for the README's release.
        forward = "kubectl port-forward -n llm svc/epdserve-proxy 8000:8000"
        assert forward in notes
        assert forward in (REPO / "README.md").read_text()
    assert "helm install epdserve helm/epdserve -n llm" in (REPO / "README.md").read_text()
    assert ("Authorization: Bearer" in notes) == any(
        e["name"] == "EPDSERVE_API_KEY" for d in of_kind(objects, "Deployment") for e in main_container(d)["env"])


def test_grafana_dashboard_is_a_configmap_for_the_sidecar_when_asked(render, served):
    import json

    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    assert not [c for c in of_kind(render(None)[1], "ConfigMap") if "epdserve.json" in c["data"]], "off by default"
    objects = render(CHART / "ci" / "ingress-monitoring-values.yaml")[1]
    (configmap,) = [c for c in of_kind(objects, "ConfigMap") if "epdserve.json" in c["data"]]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "epdserve"}
    assert json.loads(configmap["data"]["epdserve.json"]) == dashboard
    # Its model variable matches the proxy's and the engines' model_name: every role is given the name.
    for deployment in of_kind(objects, "Deployment"):
        assert served(deployment)[0].served_model_name == "llava-demo", deployment["metadata"]["name"]
