"""compose.yaml as docker compose v2 itself resolves it: valid for every profile, and wired so that the
proxy finds every role, every health check hits the port its process serves, and nothing runs as root."""
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
CURVE_OVERLAY = REPO / "deploy" / "compose.curve.yaml"
UCX_OVERLAY = REPO / "compose.ucx.yaml"
PROFILES = [(), ("gpu",), ("monitoring",), ("gpu", "monitoring"), ("planner", "monitoring")]
ENGINE_ROLES = ("encoder", "prefill", "decode")


@pytest.fixture(scope="module")
def epdserve_services(parse_cli):
    """services(project) -> {name: (service, parsed command)} for every service running `epdserve serve`."""

    def services(project):
        return {name: (s, parse_cli(s["command"])) for name, s in project["services"].items()
                if (s.get("command") or [])[:2] == ["epdserve", "serve"]}

    return services


def dns_names(name, service):
    """The names compose's DNS answers with this service's replicas: its own and its network aliases."""
    return [name, *(service["networks"]["default"] or {}).get("aliases", [])]


# Ids never equal "gpu": the suite skips tests carrying that keyword when no GPU is present.
@pytest.mark.parametrize("profiles", PROFILES, ids=lambda p: "profiles=" + ("+".join(p) or "none"))
def test_compose_config_is_valid(compose, profiles):
    done = compose(*[a for p in profiles for a in ("--profile", p)], "config", "-q")
    assert done.returncode == 0, done.stderr


def test_compose_file_matches_the_compose_spec(validate):
    done = validate("check-jsonschema", "--builtin-schema", "vendor.compose-spec", COMPOSE_FILE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_command_is_accepted_by_the_cli(compose_config, epdserve_services):
    services = epdserve_services(compose_config("gpu", "monitoring"))
    assert sorted(args.role for _, args in services.values()) == ["decode", "decode", "encoder", "prefill",
                                                                  "prefill", "proxy"]
    for name, (_, args) in services.items():
        assert args.host == "0.0.0.0", f"{name} must listen beyond its container"
        # Peers dial what it advertises: by default the container hostname, which compose's DNS resolves.
        assert args.advertise_host is None, name


def test_prefills_send_blocks_on_a_port_of_their_own(compose_config, epdserve_services):
    for name, (_, args) in epdserve_services(compose_config("gpu")).items():
        if args.role == "prefill":  # fixed, so that a firewall between hosts can let it through
            assert args.block_port and len({args.port, args.data_port, args.http_port, args.block_port}) == 4, name


def test_healthchecks_hit_the_port_each_process_serves(compose_config, epdserve_services):
    for name, (service, args) in epdserve_services(compose_config("gpu")).items():
        test = service["healthcheck"]["test"]
        assert test[:2] == ["CMD", "epdserve-healthcheck"], name
        serves = args.port if args.role == "proxy" else args.http_port
        assert int(test[2]) == serves, f"{name}: health check on {test[2]}, /ready on {serves}"
        if args.role != "proxy":  # /ready answers only once the model is loaded
            assert service["healthcheck"]["start_period"] == "10m0s", name


def test_proxy_targets_are_the_services_running_each_role(compose_config, epdserve_services):
    services = epdserve_services(compose_config("gpu"))
    proxy = services["proxy"][1]
    for role, targets in (("encoder", proxy.encoder), ("prefill", proxy.prefill), ("decode", proxy.decode)):
        (target,) = targets
        host, port = target.rsplit(":", 1)
        answering = {n: args for n, (s, args) in services.items() if host in dns_names(n, s)}
        assert role in answering, f"--{role} {target}: no {role} service answers to {host}"
        for name, args in answering.items():
            assert (args.role, args.port) == (role, int(port)), f"{name} answers to {target}"


def test_proxy_waits_for_healthy_engines_and_alone_is_published(compose_config, parse_cli):
    project = compose_config()
    proxy = project["services"]["proxy"]
    assert {n: d["condition"] for n, d in proxy["depends_on"].items()} == dict.fromkeys(ENGINE_ROLES,
                                                                                        "service_healthy")
    (published,) = proxy["ports"]
    assert published["target"] == parse_cli(proxy["command"]).port
    assert published["host_ip"] == "127.0.0.1"  # beyond the host only when asked (EPDSERVE_BIND)
    for name in ENGINE_ROLES:  # a published port would stop `--scale`
        assert not project["services"][name].get("ports"), name


def test_replicas_have_no_fixed_names(compose_config):
    for name, service in compose_config("gpu", "monitoring")["services"].items():
        assert "container_name" not in service and "hostname" not in service, name


def test_no_container_runs_as_root_or_gains_privileges(compose_config, epdserve_services):
    for name, (service, _) in epdserve_services(compose_config("gpu")).items():
        assert "user" not in service, f"{name} overrides the image's non-root user"
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert not service.get("privileged"), name
        # /tmp is the one writable path; triton must be able to load what it compiles there.
        (tmp,) = [t for t in service["tmpfs"] if t.split(":")[0] == "/tmp"]
        assert "exec" in tmp.partition(":")[2].split(","), name


def test_gpu_profile_adds_cuda_engines_with_a_gpu_each(compose_config, parse_cli):
    cpu, gpu = compose_config()["services"], compose_config("gpu")["services"]
    assert not {"prefill-gpu", "decode-gpu"} & cpu.keys()
    for name in ("prefill-gpu", "decode-gpu"):
        service = gpu[name]
        assert parse_cli(service["command"]).device == "cuda"
        assert service["build"]["args"]["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")
        assert service["image"] != cpu["prefill"]["image"], "a CPU build of torch cannot use the GPU"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["count"] == 1


def test_api_key_comes_from_the_environment(compose_config, parse_cli):
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    assert raw["services"]["proxy"]["environment"]["EPDSERVE_API_KEY"].startswith("${EPDSERVE_API_KEY")
    assert compose_config()["services"]["proxy"]["environment"]["EPDSERVE_API_KEY"] == ""  # unset: open API
    keyed = compose_config(EPDSERVE_API_KEY="s3cret")["services"]["proxy"]
    assert keyed["environment"]["EPDSERVE_API_KEY"] == "s3cret"
    assert "--api-key" not in keyed["command"]  # command lines are visible to anyone who can list processes


def test_curve_overlay_gives_every_service_the_certificate(compose, parse_cli, epdserve_services, monkeypatch):
    import json

    files = (COMPOSE_FILE, CURVE_OVERLAY)
    done = compose("--profile", "gpu", "config", "--format", "json", files=files, EPDSERVE_CURVE_DIR="/srv/curve")
    assert done.returncode == 0, done.stderr
    for name, (service, _) in epdserve_services(json.loads(done.stdout)).items():
        (mount,) = [v for v in service["volumes"] if v["source"] == "/srv/curve"]
        assert mount["read_only"], name
        # --curve-dir defaults to $EPDSERVE_CURVE_DIR, as in the container.
        monkeypatch.setenv("EPDSERVE_CURVE_DIR", service["environment"]["EPDSERVE_CURVE_DIR"])
        assert parse_cli(service["command"]).curve_dir == mount["target"], name
    done = compose("config", "-q", files=files)
    assert done.returncode != 0 and "EPDSERVE_CURVE_DIR" in done.stderr, "the folder must be named"


def test_ucx_overlay_switches_every_engine_and_only_the_engines(compose, compose_config, parse_cli, epdserve_services,
                                                                monkeypatch):
    import json

    def project(**env):
        done = compose("--profile", "gpu", "config", "--format", "json", files=(COMPOSE_FILE, UCX_OVERLAY), **env)
        assert done.returncode == 0, done.stderr
        return epdserve_services(json.loads(done.stdout))

    for env, devices in (({}, "all"), ({"EPDSERVE_UCX_NET_DEVICES": "eth0"}, "eth0")):
        services = project(**env)
        assert sorted(services) == ["decode", "decode-gpu", "encoder", "prefill", "prefill-gpu", "proxy"]
        for name, (service, _) in services.items():
            # The CLI reads the service's environment as the container's process would.
            for variable in ("EPDSERVE_KV_TRANSPORT", "EPDSERVE_UCX_NET_DEVICES"):
                monkeypatch.delenv(variable, raising=False)
                if variable in service["environment"]:
                    monkeypatch.setenv(variable, service["environment"][variable])
            args = parse_cli(service["command"])
            if name == "proxy":
                assert "EPDSERVE_KV_TRANSPORT" not in service["environment"]
                continue
            assert (args.kv_transport, args.ucx_net_devices) == ("ucx", devices), name
            assert service["environment"]["EPDSERVE_LOG_LEVEL"], f"{name}: the overlay replaced the environment"
    monkeypatch.delenv("EPDSERVE_KV_TRANSPORT", raising=False)
    for name, (service, args) in epdserve_services(compose_config("gpu")).items():
        assert "EPDSERVE_KV_TRANSPORT" not in service["environment"]
        assert args.kv_transport == "zmq", f"{name}: without the overlay every service stays on ZMQ"


def test_prometheus_scrapes_every_metrics_port(compose_config, epdserve_services):
    project = compose_config("gpu", "monitoring")
    prometheus = project["services"]["prometheus"]
    (mount,) = [v for v in prometheus["volumes"] if v["target"] == "/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(Path(mount["source"]).read_text())
    scraped = {name: (sd["port"], job) for job in config["scrape_configs"] for sd in job["dns_sd_configs"]
               for name in sd["names"]}
    for name, (service, args) in epdserve_services(project).items():
        port, job = next(scraped[n] for n in dns_names(name, service) if n in scraped)
        assert port == (args.port if args.role == "proxy" else args.http_port), name
        if args.role == "proxy":  # the key, for a proxy whose /metrics needs it (--metrics-require-api-key)
            credentials = job["authorization"]["credentials_file"]
            assert credentials in [s["target"] for s in prometheus["secrets"]]


def test_the_planner_reads_the_proxy_and_is_scraped_keeping_its_role_label(compose_config, epdserve_services):
    from epdserve.services.planner.autoscaler import parse_bounds

    assert "planner" not in compose_config()["services"], "only with the planner profile"
    project = compose_config("planner", "monitoring", EPDSERVE_PLANNER_BOUNDS="decode=1:3", EPDSERVE_API_KEY="k",
                             EPDSERVE_PLANNER_MAX_INSTANCES="4")
    services = epdserve_services(project)
    service, args = services["planner"]
    assert args.role == "planner" and parse_bounds(args.planner_bounds) == {"decode": (1, 3)}
    host, port = args.proxy_url.removeprefix("http://").rsplit(":", 1)
    assert services[host][1].role == "proxy" and services[host][1].port == int(port)
    assert service["environment"]["EPDSERVE_API_KEY"] == "k"  # to read the proxy's /ready
    assert service["environment"]["EPDSERVE_PLANNER_MAX_INSTANCES"] == "4"  # serve planner's budget (test_cli)
    assert service["depends_on"]["proxy"]["condition"] == "service_healthy"
    assert int(service["healthcheck"]["test"][2]) == args.http_port
    default = compose_config("planner")["services"]["planner"]["command"]
    assert parse_bounds(default[default.index("--planner-bounds") + 1]) == {"encoder": (1, 2), "prefill": (1, 2),
                                                                            "decode": (1, 2)}
    (mount,) = [v for v in project["services"]["prometheus"]["volumes"] if v["target"] == "/etc/prometheus/prometheus.yml"]
    (job,) = [j for j in yaml.safe_load(Path(mount["source"]).read_text())["scrape_configs"]
              if "planner" in j["dns_sd_configs"][0]["names"]]
    assert job["dns_sd_configs"][0]["port"] == args.http_port and job["honor_labels"] is True


def test_grafana_provisions_the_charts_dashboard_on_prometheus(compose_config):
    project = compose_config("monitoring")
    assert "grafana" not in compose_config()["services"], "only with the monitoring profile"
    grafana, prometheus = project["services"]["grafana"], project["services"]["prometheus"]
    mounts = {v["target"]: v for v in grafana["volumes"]}
    provisioning = Path(mounts["/etc/grafana/provisioning"]["source"])
    assert mounts["/etc/grafana/provisioning"]["read_only"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    host, port = datasource["url"].removeprefix("http://").split(":")
    assert host == "prometheus" and int(port) == prometheus["ports"][0]["target"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "epdserve.yml").read_text())["providers"]
    dashboards = [m for t, m in mounts.items() if t.startswith(provider["options"]["path"] + "/")]
    assert [Path(m["source"]) for m in dashboards] == [REPO / "helm" / "epdserve" / "files" / "grafana-dashboard.json"]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboards[0]["target"]
    (published,) = grafana["ports"]
    assert published["host_ip"] == "127.0.0.1"


def test_docker_waits_for_every_drain_before_killing(compose_config, epdserve_services):
    # `docker compose stop` sends SIGTERM, waits stop_grace_period, then kills: the drain must end first,
    # with a few seconds to cut what is left and exit.
    for drain in (None, "45"):
        env = {} if drain is None else {"EPDSERVE_DRAIN_TIMEOUT": drain}
        for name, (service, args) in epdserve_services(compose_config("gpu", **env)).items():
            grace = service["stop_grace_period"]
            assert grace.endswith("s") and grace[:-1].isdigit(), grace
            assert "--drain-timeout" in service["command"], f"{name}: the drain timeout, stated beside the grace"
            if drain is None:
                assert args.drain_timeout + 10 <= int(grace[:-1]), f"{name}: drain {args.drain_timeout} s, grace {grace}"
            else:  # the documented ceiling of EPDSERVE_DRAIN_TIMEOUT
                assert args.drain_timeout <= int(grace[:-1]), name


def test_every_service_proves_a_secret_made_once_for_the_deployment(compose_config, epdserve_services):
    """Services bind 0.0.0.0: each refuses to start without the deployment's secret, which fill-volumes makes
    (never over an existing one) into a volume every service mounts read-only."""
    project = compose_config("gpu", "monitoring", "kvstore")
    fill = project["services"]["fill-volumes"]
    (made,) = [v for v in fill["volumes"] if v["source"] == "secret"]
    assert not made.get("read_only")
    assert fill["command"] == ["sh", "-c", f"test -s {made['target']}/secret || epdserve keys --secret "
                                           f"{made['target']}/secret"]
    services = epdserve_services(project)
    assert {"encoder", "prefill", "decode", "kvstore", "proxy"} <= set(services)
    for name, (service, args) in services.items():
        (mount,) = [v for v in service["volumes"] if v["source"] == "secret"]
        assert mount["read_only"] and mount["target"] == made["target"], name
        assert service["environment"]["EPDSERVE_SECRET_FILE"] == f"{made['target']}/secret", name
        assert "EPDSERVE_SECRET" not in service["environment"], name  # the file, never the secret itself


def test_volumes_from_the_image_are_filled_by_one_container_before_the_others(compose_config):
    """Docker fills an empty named volume from the image when a container mounting it is created; two
    created at once race on that copy and one fails. One one-shot service fills them, alone, first."""
    services = compose_config("gpu", "monitoring")["services"]
    fill = services["fill-volumes"]
    assert fill["restart"] == "no"
    filled = {v["source"] for v in fill["volumes"] if v["type"] == "volume"}
    assert {"models", "secret"} <= filled

    def created_after_fill(name: str) -> bool:
        """Waits for fill-volumes to exit 0, itself or through a service that does (the proxy)."""
        after = services[name].get("depends_on", {})
        if "fill-volumes" in after:
            return after["fill-volumes"]["condition"] == "service_completed_successfully"
        return any(created_after_fill(d) for d in after)

    for name, service in services.items():
        if name != "fill-volumes" and {v.get("source") for v in service.get("volumes", [])} & filled:
            assert created_after_fill(name), name
