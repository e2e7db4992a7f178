"""The Helm chart through the real helm binary: lint, render with every value set, Kubernetes schema
validation, refusal of bad values; then the rendered objects read back and checked for what matters."""
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "epdserve"
VALUES = Path(__file__).parent / "values"
GOOD_VALUES = [None, *sorted((CHART / "ci").glob("*.yaml")),
               *sorted(p for p in VALUES.glob("*.yaml") if not p.name.startswith("bad-"))]
BAD_VALUES = sorted(VALUES.glob("bad-*.yaml"))
# Custom resources of optional operators (prometheus-operator, KEDA): kubernetes-validate has no schema.
CUSTOM_KINDS = ("ServiceMonitor", "ScaledObject")
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


def serving(objects):
    """The Deployments of the roles that serve requests (not the planner, which reads the proxy's metrics)."""
    return [d for d in of_kind(objects, "Deployment") if d["metadata"]["labels"][ROLE_LABEL] != "planner"]


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
    if args.block_port:
        ports["blocks"] = args.block_port
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
    # Only the optional CRDs may go unchecked: every built-in kind has a schema.
    unchecked = [line for line in done.stdout.splitlines() if "Couldn't find schema" in line]
    assert all(any(kind in line for kind in CUSTOM_KINDS) for line in unchecked), unchecked
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
    for deployment in serving(render(values)[1]):
        args, declared = served(deployment)
        listening = listening_ports(args)
        assert sorted(declared.items()) == sorted((port, name) for name, port in listening.items()), \
            f"{deployment['metadata']['name']}: declared {declared}, listening {listening}"
        container = main_container(deployment)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["port"] == "http" and listening["http"] in declared, (deployment["metadata"]["name"], probe)
            assert get["path"] in ("/health", "/ready")
        # The startup budget covers loading a model, whatever the startup probe asks.
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_proxy_discovers_each_role_through_its_headless_service(render, served, values):
    objects = render(values)[1]
    deployments = {d["metadata"]["labels"][ROLE_LABEL]: d for d in serving(objects)}
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
    for deployment in serving(render(values)[1]):
        args, _ = served(deployment)
        assert args.host == "0.0.0.0" and args.advertise_host == "$(POD_IP)"
        env = {e["name"]: e for e in main_container(deployment)["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_services_route_to_declared_container_ports(render, values):
    objects = render(values)[1]
    pods = [d["spec"]["template"] for d in of_kind(objects, "Deployment") + of_kind(objects, "StatefulSet")]
    for service in of_kind(objects, "Service"):
        (pod,) = [p for p in pods if selects(service["spec"]["selector"], p["metadata"]["labels"])]
        names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, (service["metadata"]["name"], port)


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_nothing_runs_as_root_or_writes_its_image(render, values):
    objects = render(values)[1]
    for obj in of_kind(objects, "Deployment") + of_kind(objects, "StatefulSet") + of_kind(objects, "Pod"):
        spec = obj["spec"]["template"]["spec"] if obj["kind"] != "Pod" else obj["spec"]
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


@pytest.mark.parametrize("values, transport, devices", [(None, "zmq", None),
                                                        (CHART / "ci" / "ucx-values.yaml", "ucx", "eth0")],
                         ids=["defaults", "ucx-values"])
def test_every_engine_gets_the_same_kv_transport(render, served, values, transport, devices):
    roles = set()
    for deployment in of_kind(render(values)[1], "Deployment"):
        args, _ = served(deployment)
        container_args = main_container(deployment)["args"]
        roles.add(args.role)
        if args.role == "proxy":
            assert "--kv-transport" not in container_args  # it moves no KV
            continue
        assert args.kv_transport == transport, args.role
        assert "--kv-transport" in container_args, "stated, not left to a default"
        if devices is None:
            assert "--ucx-net-devices" not in container_args
        else:
            assert args.ucx_net_devices == devices, args.role
    assert roles == {"encoder", "prefill", "decode", "proxy"}


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
            assert args.served_model_name == ["llava-demo"]
            assert args.metrics_require_api_key  # apiKey.protectMetrics
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
        assert served(deployment)[0].served_model_name == ["llava-demo"], deployment["metadata"]["name"]


# -- shutdown, autoscaling, model download, scheduling, resources ------------------------------------------
def chart_values(values_file):
    """The chart's values with `values_file` over them (maps merged, as helm does)."""
    import yaml

    def merge(base, over):
        for key, value in over.items():
            base[key] = merge(base.get(key, {}), value) if isinstance(value, dict) and isinstance(
                base.get(key), dict) else value
        return base

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return merge(values, yaml.safe_load(values_file.read_text()) or {}) if values_file else values


def deployments_by_role(objects):
    return {d["metadata"]["labels"][ROLE_LABEL]: d for d in of_kind(objects, "Deployment")}


@pytest.mark.parametrize("values", GOOD_VALUES, ids=value_id)
def test_every_pod_outlives_its_drain(render, served, values):
    """preStop sleep, then SIGTERM and the service's own --drain-timeout: the kubelet's grace covers both
    with room for the cut streams' last events, so it never SIGKILLs a pod that is still draining."""
    shutdown = chart_values(values)["shutdown"]
    for deployment in serving(render(values)[1]):
        args, _ = served(deployment)
        pod = deployment["spec"]["template"]["spec"]
        assert args.drain_timeout == shutdown["drainTimeoutSeconds"]
        sleep = shutdown["preStopSleepSeconds"]
        pre_stop = main_container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop == ["sleep", str(sleep)]
        assert pod["terminationGracePeriodSeconds"] >= sleep + args.drain_timeout + 10, deployment["metadata"]["name"]


def test_autoscaling_reads_the_engines_queue_through_the_adapter_metric(render, served):
    assert not of_kind(render(None)[1], "HorizontalPodAutoscaler"), "off by default"
    objects = render(VALUES / "hub-model-cache.yaml")[1]
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    deployment = deployments_by_role(objects)["decode"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "epdserve_requests_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "3"}
    # The README's prometheus-adapter rule makes the chart's default name from the engines' gauge.
    readme = (REPO / "README.md").read_text()
    default_name = chart_values(None)["autoscaling"]["queueMetricName"]
    assert "seriesQuery: 'vllm:num_requests_waiting" in readme and f"as: {default_name}" in readme
    # A role set to CPU gets a CPU target instead.
    xpyd = {h["spec"]["scaleTargetRef"]["name"]: h for h in
            of_kind(render(CHART / "ci" / "xpyd-values.yaml")[1], "HorizontalPodAutoscaler")}
    kinds = {name.rsplit("-", 1)[1]: h["spec"]["metrics"][0]["type"] for name, h in xpyd.items()}
    assert kinds == {"prefill": "Pods", "decode": "Resource"}


def test_keda_scales_engines_on_their_queue_from_prometheus(render):
    objects = render(VALUES / "keda-queue-autoscaling.yaml")[1]
    assert not of_kind(objects, "HorizontalPodAutoscaler"), "KEDA makes its own"
    deployments = deployments_by_role(objects)
    services = by_name(objects, "Service")
    scaled = {s["metadata"]["labels"][ROLE_LABEL]: s for s in of_kind(objects, "ScaledObject")}
    assert set(scaled) == set(deployments) == {"encoder", "prefill", "decode", "proxy"}
    for role, obj in scaled.items():
        deployment = deployments[role]
        assert obj["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert "replicas" not in deployment["spec"]
        (trigger,) = obj["spec"]["triggers"]
        if role in ("encoder", "proxy"):
            assert trigger["type"] == "cpu" and trigger["metadata"]["value"] == "80"
            continue
        assert trigger["type"] == "prometheus"
        assert trigger["metadata"]["serverAddress"] == "http://prometheus.monitoring.svc:9090"
        query = trigger["metadata"]["query"]
        assert query.startswith("sum(vllm:num_requests_waiting{") and 'namespace="llm"' in query
        # The service label prometheus-operator gives every target: the role's headless Service.
        service = services[query.split('service="')[1].split('"')[0]]
        assert selects(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert scaled["prefill"]["spec"]["triggers"][0]["metadata"]["threshold"] == "4"
    assert (scaled["decode"]["spec"]["minReplicaCount"], scaled["decode"]["spec"]["maxReplicaCount"]) == (2, 10)
    assert of_kind(objects, "ServiceMonitor"), "the query needs the engines scraped"


def test_the_planner_sets_the_replicas_of_the_roles_that_scale_on_it(helm, render, parse_cli, tmp_path):
    from epdserve.services.planner.autoscaler import parse_bounds
    from epdserve.services.planner.profile import EngineProfile

    values = VALUES / "keda-planner-autoscaling.yaml"
    objects = render(values)[1]
    deployments, services = deployments_by_role(objects), by_name(objects, "Service")
    planner = deployments["planner"]
    container = main_container(planner)
    args = parse_cli(container["command"] + container["args"])
    assert args.role == "planner" and parse_bounds(args.planner_bounds) == {"encoder": (1, 3), "decode": (2, 6)}
    assert (args.ttft_slo, args.tpot_slo, args.planner_interval, args.planner_max_instances) == (1.5, 0.04, 5.0, 7)
    # It reads the proxy through the proxy's Service, with the API key.
    host, port = args.proxy_url.removeprefix("http://").rsplit(":", 1)
    assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
    assert selects(services[host]["spec"]["selector"], deployments["proxy"]["spec"]["template"]["metadata"]["labels"])
    (key,) = [e for e in container["env"] if e["name"] == "EPDSERVE_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "api-key", "key": "api-key"}
    # Its profile: the values' JSON, mounted where --planner-profile points, and a profile the planner reads.
    (config,) = [c for c in of_kind(objects, "ConfigMap") if "profile.json" in c.get("data", {})]
    mount = next(m for m in container["volumeMounts"] if args.planner_profile.startswith(m["mountPath"] + "/"))
    assert next(v for v in planner["spec"]["template"]["spec"]["volumes"]
                if v["name"] == mount["name"])["configMap"]["name"] == config["metadata"]["name"]
    profile = tmp_path / "profile.json"
    profile.write_text(config["data"]["profile.json"])
    assert EngineProfile.load(profile).encode == 0.1
    # KEDA scales the planner's roles to what it exports; the prefills still on their queue.
    scaled = {s["metadata"]["labels"][ROLE_LABEL]: s for s in of_kind(objects, "ScaledObject")}
    for role in ("encoder", "decode"):
        (trigger,) = scaled[role]["spec"]["triggers"]
        assert trigger["metadata"]["query"] == f'max(epdserve:planner_desired_replicas{{namespace="llm",role="{role}"}})'
        assert trigger["metadata"]["threshold"] == "1"
    assert scaled["prefill"]["spec"]["triggers"][0]["metadata"]["query"].startswith("sum(vllm:num_requests_waiting")
    # Prometheus scrapes it through a port of its own, keeping the metric's role label.
    (monitor,) = of_kind(objects, "ServiceMonitor")
    (endpoint,) = [e for e in monitor["spec"]["endpoints"] if e["port"] == "planner"]
    assert endpoint["honorLabels"] is True
    assert [p["name"] for p in services[planner["metadata"]["name"]]["spec"]["ports"]] == ["planner"]
    # Without KEDA, an HPA reads the same metric from the external metrics API (prometheus-adapter).
    done = helm("template", "rel", CHART, "--namespace", "llm", "-f", values, "--set", "autoscaling.keda.enabled=false")
    assert done.returncode == 0, done.stderr
    hpas = {h["spec"]["scaleTargetRef"]["name"].rsplit("-", 1)[1]: h for h in
            of_kind([o for o in yaml.safe_load_all(done.stdout) if o], "HorizontalPodAutoscaler")}
    (metric,) = hpas["decode"]["spec"]["metrics"]
    assert metric["external"]["metric"] == {"name": "epdserve_planner_desired_replicas",
                                            "selector": {"matchLabels": {"role": "decode"}}}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    # A planner that no role scales on is refused, saying so.
    done = helm("template", "rel", CHART, "--set", "planner.enabled=true")
    assert done.returncode != 0 and "no role scales on it" in done.stderr


def test_hub_source_downloads_into_the_chart_pvc_with_a_token_from_a_secret(render, served):
    import importlib.metadata

    objects = render(VALUES / "hub-model-cache.yaml")[1]
    (claim,) = of_kind(objects, "PersistentVolumeClaim")
    assert claim["spec"]["storageClassName"] == "nfs-client" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    snippet = (CHART / "files" / "hub_download.py").read_text()
    compile(snippet, "hub_download.py", "exec")
    # It needs nothing the image lacks: huggingface_hub is one of transformers' own dependencies.
    assert any(r.startswith("huggingface-hub") for r in importlib.metadata.requires("transformers"))
    for deployment in of_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["command"] == ["python", "-c"] and init["args"] == [snippet]
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_HUB_OFFLINE"]["value"] == "0" and env["HF_REPO"]["value"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        args, _ = served(deployment)
        assert args.model == env["MODEL_DIR"]["value"] == "/models/HuggingFaceTB/SmolLM2-135M-Instruct"
        main = main_container(deployment)
        assert "HF_TOKEN" not in {e["name"] for e in main["env"]}, "the token stays in the init container"
        (volume,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert volume["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"]}
        assert {m["mountPath"]: m for m in init["volumeMounts"]}["/models"].get("readOnly") is not True
    assert not of_kind(render(None)[1], "PersistentVolumeClaim"), "the demo model needs no volume"


def test_each_role_spreads_its_pods_and_rolls_out_without_losing_capacity(render):
    for role, deployment in deployments_by_role(render(None)[1]).items():
        pod = deployment["spec"]["template"]["spec"]
        (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert selects(term["podAffinityTerm"]["labelSelector"]["matchLabels"],
                       deployment["spec"]["template"]["metadata"]["labels"])
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"][ROLE_LABEL] == role
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    deployments = deployments_by_role(render(VALUES / "scheduling-and-extras.yaml")[1])
    decode = deployments["decode"]["spec"]["template"]["spec"]
    (required,) = decode["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["labelSelector"]["matchLabels"][ROLE_LABEL] == "decode"
    (spread,) = decode["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert spread["labelSelector"]["matchLabels"][ROLE_LABEL] == "decode"
    assert "affinity" not in deployments["prefill"]["spec"]["template"]["spec"]
    assert deployments["prefill"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    # An explicit affinity replaces the generated rule (the xpyd set gives decode its own).
    xpyd = deployments_by_role(render(CHART / "ci" / "xpyd-values.yaml")[1])
    terms = xpyd["decode"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert terms["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 100


def test_extra_env_from_secrets_and_extra_volumes_reach_every_role(render):
    for deployment in of_kind(render(VALUES / "scheduling-and-extras.yaml")[1], "Deployment"):
        container = main_container(deployment)
        env = {e["name"]: e for e in container["env"]}
        assert env["EPDSERVE_EXTRA"]["value"] == "1"
        assert env["OTEL_EXPORTER_OTLP_HEADERS"]["valueFrom"]["secretKeyRef"] == {"name": "otel", "key": "headers"}
        assert {"secretRef": {"name": "epdserve-extra-env"}} in container["envFrom"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mounts["/etc/ssl/corporate"]]["configMap"] == {"name": "corporate-ca"}


def test_ingress_passes_server_sent_events_through_unbuffered(render):
    (ingress,) = of_kind(render(CHART / "ci" / "ingress-monitoring-values.yaml")[1], "Ingress")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "600"  # the user's value wins
    (ingress,) = of_kind(render(VALUES / "scheduling-and-extras.yaml")[1], "Ingress")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "7200"
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-send-timeout"] == "3600"


# RSS measured with `ps -o rss` of each service of a local stack serving the demo model, after a request:
# engines with their default KV pool on a 24 GB machine (1 GiB), in GB.
MEASURED_RSS_GB = {"encoder": 0.51, "prefill": 2.55, "decode": 2.55, "proxy": 0.50}


def quantity_gb(value) -> float:
    units = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "K": 1e3, "M": 1e6, "G": 1e9}
    for unit, factor in units.items():
        if str(value).endswith(unit):
            return float(str(value)[:-len(unit)]) * factor / 1e9
    return float(value) / 1e9


def test_default_memory_requests_and_limits_fit_measured_use(render):
    for role, deployment in deployments_by_role(render(None)[1]).items():
        resources = main_container(deployment)["resources"]
        measured = MEASURED_RSS_GB[role]
        assert quantity_gb(resources["requests"]["memory"]) >= measured, role
        # Headroom for a request's activations, a bigger KV share, allocator slack: twice what was seen.
        assert quantity_gb(resources["limits"]["memory"]) >= 2 * measured, role


def test_kv_store_is_a_statefulset_every_engine_is_pointed_at(render, served, parse_cli):
    objects = render(CHART / "ci" / "kvstore-values.yaml")[1]
    (store,) = of_kind(objects, "StatefulSet")
    container = main_container(store)
    args = parse_cli(container["command"] + container["args"])
    assert args.role == "kvstore" and args.kv_store_size == 2 and args.host == "0.0.0.0"
    service = by_name(objects, "Service")[store["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert selects(service["spec"]["selector"], store["spec"]["template"]["metadata"]["labels"])
    (config,) = of_kind(objects, "ConfigMap")
    name = store["metadata"]["name"]
    assert config["data"]["EPDSERVE_KV_STORE"] == f"{name}-0.{name}:{args.port}"
    for deployment in of_kind(objects, "Deployment"):
        engine, _ = served(deployment)
        if engine.role in ("prefill", "decode"):
            assert engine.kv_offloading_size == 1.0
            refs = [e["configMapRef"]["name"] for e in main_container(deployment)["envFrom"] if "configMapRef" in e]
            assert config["metadata"]["name"] in refs  # EPDSERVE_KV_STORE: their --kv-store default
    assert not of_kind(render(None)[1], "StatefulSet")  # off by default


@pytest.mark.parametrize("values", [None, CHART / "ci" / "kvstore-values.yaml"], ids=value_id)
def test_every_service_proves_a_secret_the_chart_makes(render, served, values):
    objects = render(values)[1]
    secrets = by_name(objects, "Secret")
    made = secrets["rel-epdserve-secret"]
    assert made["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(made["data"]["secret"]) >= 64  # base64 of 64 random characters
    workloads = serving(objects) + of_kind(objects, "StatefulSet")
    assert len(workloads) == len(of_kind(render(None)[1], "Deployment")) + (values is not None)
    for workload in workloads:
        container = main_container(workload)
        (env,) = [e for e in container["env"] if e["name"] == "EPDSERVE_SECRET"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "rel-epdserve-secret", "key": "secret"}
        assert not any("secret" in str(a).lower() for a in container["args"])  # never on a command line


def test_an_existing_secret_replaces_the_made_one(helm):
    done = helm("template", "rel", CHART, "--set", "secret.existingSecret=ops-secret", "--set", "secret.key=s")
    assert done.returncode == 0, done.stderr
    objects = [o for o in yaml.safe_load_all(done.stdout) if o]
    assert not of_kind(objects, "Secret")
    for deployment in of_kind(objects, "Deployment"):
        (env,) = [e for e in main_container(deployment)["env"] if e["name"] == "EPDSERVE_SECRET"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "ops-secret", "key": "s"}


def test_network_policies_let_only_the_release_reach_engine_and_store_ports(render):
    objects = render(CHART / "ci" / "kvstore-values.yaml")[1]
    policies = of_kind(objects, "NetworkPolicy")
    pods = [(w, w["spec"]["template"]["metadata"]["labels"]) for w in
            of_kind(objects, "Deployment") + of_kind(objects, "StatefulSet")]

    def selected(policy, labels):
        selector = policy["spec"]["podSelector"]
        if not selects(selector.get("matchLabels", {}), labels):
            return False
        return all(labels.get(e["key"]) not in e["values"] for e in selector.get("matchExpressions", [])
                   if e["operator"] == "NotIn")

    for workload, labels in pods:
        mine = [p for p in policies if selected(p, labels)]
        assert mine, workload["metadata"]["name"]  # every pod is isolated for ingress
        rules = [rule for p in mine for rule in p["spec"]["ingress"]]
        open_ports = {port["port"] for rule in rules if "from" not in rule for port in rule.get("ports", [])}
        assert open_ports == {"http"}, workload["metadata"]["name"]  # probes, metrics, the proxy's API
        release = [rule for rule in rules if "ports" not in rule]
        for rule in release:  # every port, but only from pods of this release
            (peer,) = rule["from"]
            assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "epdserve",
                                                          "app.kubernetes.io/instance": "rel"}
        assert release
    assert of_kind(render(None)[1], "NetworkPolicy")  # on by default
