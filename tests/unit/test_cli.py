"""The command line builds the configs the services receive."""
import json
import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from epdserve.services.cli.main import (main, parse_args, proxy_config, serve_planner_config, service_config,
                                       stack_config, transport_config)
from epdserve.services.cli import launcher
from epdserve.services.cli.launcher import PORT_OPTIONS, LocalStack, StackConfig, exit_message, free_port
from epdserve.services.runtime.network import say_if_unauthenticated, split_target


def parse(*argv):
    return parse_args(list(argv))


def test_proxy_reads_its_api_key_from_a_file(tmp_path, default_model_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    args = parse("serve", "proxy", "--api-key-file", str(key), "--decode", "d:1,d2:2", "--prefill", "p:3")
    config = proxy_config(args, str(default_model_path))
    assert config.api_key == "s3cret"
    assert config.decodes == ("d:1", "d2:2") and config.prefills == ("p:3",)
    key.write_text("")
    with pytest.raises(SystemExit, match="empty"):
        proxy_config(args, str(default_model_path))


def test_proxy_metrics_behind_the_api_key_only_when_asked_and_only_with_a_key(default_model_path, monkeypatch):
    monkeypatch.delenv("EPDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("EPDSERVE_API_KEY_FILE", raising=False)
    serve = ["serve", "proxy", "--decode", "d:1"]
    assert not proxy_config(parse(*serve, "--api-key", "k"), str(default_model_path)).metrics_require_api_key
    config = proxy_config(parse(*serve, "--api-key", "k", "--metrics-require-api-key"), str(default_model_path))
    assert config.metrics_require_api_key and config.api_key == "k"
    with pytest.raises(SystemExit, match="--metrics-require-api-key needs an API key"):
        proxy_config(parse(*serve, "--metrics-require-api-key"), str(default_model_path))


def test_proxy_needs_a_way_to_decode(default_model_path):
    with pytest.raises(ValueError, match="decode"):
        proxy_config(parse("serve", "proxy", "--prefill", "p:1"), str(default_model_path))


def test_the_reasoning_parser_reaches_the_proxy_config(default_model_path, capsys):
    serve = ["serve", "proxy", "--decode", "d:1", "--prefill", "p:1"]
    assert proxy_config(parse(*serve), str(default_model_path)).reasoning_parser is None  # off by default
    for name in ("deepseek_r1", "qwen3"):
        config = proxy_config(parse(*serve, "--reasoning-parser", name), str(default_model_path))
        assert config.reasoning_parser == name
    with pytest.raises(SystemExit) as refused:
        parse(*serve, "--reasoning-parser", "granite")
    error = str(refused.value)
    assert all(word in error for word in ("--reasoning-parser", "granite", "deepseek_r1", "qwen3")), error


def test_service_config_from_args(monkeypatch):
    monkeypatch.setenv("EPDSERVE_SECRET", "s" * 32)
    args = parse("serve", "prefill", "--host", "0.0.0.0", "--port", "7000", "--data-port", "7100",
                 "--lease-seconds", "3", "--kv-transport", "zmq")
    config = service_config(args)
    assert (config.role, config.host, config.port, config.data_port, config.lease_seconds) == \
        ("prefill", "0.0.0.0", 7000, 7100, 3.0)
    assert config.engine_id.startswith("prefill-")
    assert config.transport.secret == b"s" * 32 and "s" * 32 not in repr(config)


def test_a_service_other_hosts_can_reach_refuses_to_start_without_the_deployment_secret(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("EPDSERVE_SECRET", raising=False)
    monkeypatch.delenv("EPDSERVE_SECRET_FILE", raising=False)
    with pytest.raises(SystemExit, match=r"reachable from other hosts.*epdserve keys --secret FILE"):
        service_config(parse("serve", "kvstore", "--host", "0.0.0.0"))
    with pytest.raises(SystemExit, match="reachable from other hosts"):
        proxy_config(parse("serve", "proxy", "--model", "m", "--host", "0.0.0.0", "--decode", "127.0.0.1:7001"), "m")
    with pytest.raises(SystemExit, match="reachable from other hosts"):
        service_config(parse("serve", "kvstore", "--host", "my-host.example"))
    # On loopback nothing else reaches it: it runs (and says so as it starts: network.say_if_unauthenticated).
    assert service_config(parse("serve", "kvstore")).transport.secret is None
    assert service_config(parse("serve", "kvstore", "--host", "127.0.0.3")).transport.secret is None
    assert service_config(parse("serve", "kvstore", "--host", "::1")).transport.secret is None
    with caplog.at_level(logging.WARNING):
        say_if_unauthenticated(service_config(parse("serve", "kvstore")).transport, "127.0.0.1")
    assert "no deployment secret: peers are not authenticated" in caplog.text
    secret = tmp_path / "secret"
    assert main(["keys", "--secret", str(secret)]) == 0
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text().strip()) == 64
    with pytest.raises(SystemExit, match="cannot create"):  # never over a secret services may hold
        main(["keys", "--secret", str(secret)])
    config = service_config(parse("serve", "kvstore", "--host", "0.0.0.0", "--secret-file", str(secret)))
    assert config.transport.secret == secret.read_text().strip().encode()
    monkeypatch.setenv("EPDSERVE_SECRET", "short")
    with pytest.raises(SystemExit, match="at least 16 characters"):
        service_config(parse("serve", "kvstore"))


def test_up_gives_its_services_a_secret_of_their_own_in_their_environment_unless_given_one(monkeypatch):
    monkeypatch.delenv("EPDSERVE_SECRET", raising=False)
    monkeypatch.delenv("EPDSERVE_SECRET_FILE", raising=False)
    stack, other = LocalStack(StackConfig("m")), LocalStack(StackConfig("m"))
    secrets = {stack.environment(name)["EPDSERVE_SECRET"] for name in ("prefill-0", "decode-0", "proxy")}
    assert len(secrets) == 1 and secrets != {other.environment("proxy")["EPDSERVE_SECRET"]}
    assert not any(arg in secrets for _, argv in stack.commands() for arg in argv)
    monkeypatch.setenv("EPDSERVE_SECRET", "t" * 32)
    assert LocalStack(StackConfig("m")).environment("kvstore-0")["EPDSERVE_SECRET"] == "t" * 32


def test_profile_moe_reaches_the_engine_config(default_model_path):
    from epdserve.services.cli.main import engine_config

    assert engine_config(parse("serve", "unified", "--profile-moe"), str(default_model_path)).profile_moe
    assert not engine_config(parse("serve", "decode"), str(default_model_path)).profile_moe


@pytest.mark.parametrize("target, expected", [
    ("127.0.0.1:7002", ("127.0.0.1", 7002)), ("tcp://prefill:7000", ("prefill", 7000)),
    ("[fd00::5]:7002", ("fd00::5", 7002)), ("fd00::5:7002", ("fd00::5", 7002)), ("p:65535", ("p", 65535)),
])
def test_peer_addresses(target, expected):
    assert split_target(target) == expected


@pytest.mark.parametrize("target, message", [
    ("127.0.0.1", "not HOST:PORT"), (":7002", "not HOST:PORT"), ("host:port", "not HOST:PORT"),
    ("host:0", "not between 1 and 65535"), ("host:99999", "not between 1 and 65535"),
    ("http://host:7002", "without a scheme"), ("host/x:7002", "not a host name"),
])
def test_malformed_peer_addresses_are_refused(target, message):
    with pytest.raises(ValueError, match=message):
        split_target(target)


def test_log_level_after_the_command_wins():
    assert parse("up").log_level == "info"
    assert parse("--log-level", "WARNING", "up").log_level == "warning"
    assert parse("--log-level", "warning", "up", "--log-level", "debug").log_level == "debug"
    assert parse("serve", "decode", "--log-level", "error").log_level == "error"


def test_proxy_access_log_only_at_debug(default_model_path):
    argv = ["serve", "proxy", "--decode", "d:1"]
    assert not proxy_config(parse(*argv), str(default_model_path)).access_log
    assert proxy_config(parse(*argv, "--log-level", "debug"), str(default_model_path)).access_log


def test_rpc_timeout_still_reads_its_old_spelling(capsys):
    assert transport_config(parse("serve", "decode")).rpc_timeout == 30.0
    assert transport_config(parse("serve", "decode", "--rpc-timeout", "5")).rpc_timeout == 5.0
    assert transport_config(parse("serve", "decode", "--request-timeout", "7")).rpc_timeout == 7.0
    with pytest.raises(SystemExit):
        parse("serve", "decode", "--help")
    usage = capsys.readouterr().out
    assert "--rpc-timeout" in usage and "--request-timeout" not in usage


def test_model_names_one_thing_each():
    assert parse("model", "llava-demo").which == "llava-demo"
    assert parse("model", "smollm2").which == "smollm2"
    assert parse("model", "gemma3-270m").which == "gemma3-270m"
    with pytest.raises(SystemExit):
        parse("model", "default")  # which one? `up` serves llava-demo; SmolLM2 is smollm2


def test_up_keeps_the_api_key_off_every_command_line(tmp_path, default_model_path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    args = parse("up", "--api-key-file", str(key), "--log-level", "warning", "--", "--max-num-seqs", "4")
    stack = LocalStack(stack_config(args, str(default_model_path)))
    assert stack.config.api_key == "s3cret" and stack.config.engine_args == ("--max-num-seqs", "4")
    commands = stack.commands()
    assert all("s3cret" not in " ".join(argv) for _, argv in commands)
    assert all(argv[argv.index("--log-level") + 1] == "warning" for _, argv in commands)
    assert stack.environment("proxy")["EPDSERVE_API_KEY"] == "s3cret"
    assert "EPDSERVE_API_KEY" not in stack.environment("decode-0")


def test_up_gives_every_engine_the_same_kv_transport(default_model_path):
    def transports(*argv):
        commands = LocalStack(stack_config(parse("up", "--encoders", "1", *argv), str(default_model_path))).commands()
        engines = {name: argv[argv.index("serve"):] for name, argv in commands if name != "proxy"}
        assert set(engines) == {"encoder-0", "prefill-0", "decode-0"}
        (proxy,) = [argv for name, argv in commands if name == "proxy"]
        assert "--kv-transport" not in proxy  # the proxy moves no KV
        # Each engine's command line, read back as `epdserve serve` reads it.
        return {name: transport_config(parse(*serve)) for name, serve in engines.items()}

    assert [(t.kv_transport, t.transfer_options()) for t in transports().values()] == [("zmq", {})] * 3
    ucx = transports("--kv-transport", "ucx", "--ucx-net-devices", "lo", "--", "--max-num-seqs", "4")
    assert {(t.kv_transport, t.ucx_net_devices) for t in ucx.values()} == {("ucx", "lo")}
    assert {(t.kv_transport, t.ucx_net_devices) for t in transports("--kv-transport", "ucx").values()} == \
        {("ucx", "all")}
    assert transport_config(parse("serve", "decode", "--kv-backend", "ucx")).kv_transport == "ucx"  # the old name


def test_up_gives_int8_quantization_to_every_engine_and_checks_it_once(tiny_model_paths, default_model_path):
    folder = str(tiny_model_paths["llama"])
    commands = dict(LocalStack(stack_config(parse("up", "--quantization", "int8"), folder)).commands())
    engines = {name: argv for name, argv in commands.items() if name != "proxy"}
    assert set(engines) == {"prefill-0", "decode-0"}
    assert all(argv[argv.index("--quantization") + 1] == "int8" for argv in engines.values())
    assert "--quantization" not in commands["proxy"]
    with pytest.raises(SystemExit, match="--quantization int8: .* ships quantized weights"):
        stack_config(parse("up", "--quantization", "int8"), str(default_model_path))


@pytest.mark.parametrize("extra", [["--kv-transport", "ucx"], ["--kv-backend=ucx"], ["--ucx-net-devices", "lo"],
                                   ["--served-model-name", "smol"], ["--served-model-name=smol"]])
def test_up_refuses_after_the_double_dash_what_it_gives_every_service(default_model_path, extra):
    # After --, the option would reach prefills and decodes but not the encoders (nor the proxy): a stack at
    # odds with itself.
    with pytest.raises(SystemExit, match=f"give {extra[0].split('=')[0]} before --"):
        stack_config(parse("up", "--", "--max-num-seqs", "4", *extra), str(default_model_path))


def test_up_gives_every_service_the_served_model_name(default_model_path):
    commands = dict(LocalStack(stack_config(parse("up", "--encoders", "1", "--served-model-name", "smol"),
                                            str(default_model_path))).commands())
    proxy = commands.pop("proxy")
    assert proxy_config(parse(*proxy[proxy.index("serve"):]), str(default_model_path)).model_name == "smol"
    assert set(commands) == {"encoder-0", "prefill-0", "decode-0"}
    for argv in commands.values():  # read back as each service reads its command line
        assert service_config(parse(*argv[argv.index("serve"):])).served_model_name == "smol"
    unnamed = dict(LocalStack(stack_config(parse("up"), str(default_model_path))).commands())
    assert not any("--served-model-name" in argv for argv in unnamed.values())  # each takes the folder's name


def listening_ports(commands) -> list[int]:
    """Every port the stack's services listen on, but the API's."""
    return [int(argv[i + 1]) for name, argv in commands for i, arg in enumerate(argv)
            if arg in PORT_OPTIONS[name.split("-")[0]]]


def test_up_takes_its_internal_ports_from_a_range_skipping_busy_ones(default_model_path):
    def commands(*argv):
        return LocalStack(stack_config(parse("up", "--encoders", "1", "--port", "1", *argv),
                                       str(default_model_path))).commands()

    anywhere = listening_ports(commands())
    assert len(anywhere) == len(set(anywhere)) == 3 + 4 + 2 + 1  # encoder, prefill, decode, the proxy's inbox
    low = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", low + 1))
        busy.listen()
        ports = listening_ports(commands("--internal-ports", f"{low}-{low + 20}"))
        assert ports == [p for p in range(low, low + 11) if p != low + 1]
        with pytest.raises(SystemExit, match=rf"--internal-ports {low}-{low + 9} has 9 free ports; this stack's "
                                             r"services listen on 10"):
            commands("--internal-ports", f"{low}-{low + 9}")
    with pytest.raises(SystemExit, match="keep the API's port out of it"):
        stack_config(parse("up", "--port", str(low), "--internal-ports", f"{low}-{low + 20}"), str(default_model_path))


def test_make_run_serves_on_the_port_given():
    def run_command(*variables):
        # --no-print-directory: under `make test` this runs as a sub-make, which would add its own lines.
        done = subprocess.run(["make", "--no-print-directory", "-n", "run", *variables], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parents[2])
        return done.stdout.strip().splitlines()[-1]

    assert run_command("PORT=8123").endswith("epdserve up --port 8123")
    assert run_command().endswith("epdserve up --port 8000")


def test_up_refuses_empty_ucx_net_devices(default_model_path):
    with pytest.raises(SystemExit, match="ucx_net_devices must name devices"):
        stack_config(parse("up", "--kv-transport", "ucx", "--ucx-net-devices", " "), str(default_model_path))


def test_the_kv_transport_defaults_to_the_environment(monkeypatch, default_model_path):
    # How compose.ucx.yaml switches every engine of a deployment at once.
    monkeypatch.setenv("EPDSERVE_KV_TRANSPORT", "ucx")
    monkeypatch.setenv("EPDSERVE_UCX_NET_DEVICES", "eth0")
    config = transport_config(parse("serve", "prefill"))
    assert (config.kv_transport, config.transfer_options()) == ("ucx", {"net_devices": "eth0"})
    assert transport_config(parse("serve", "prefill", "--kv-transport", "zmq")).transfer_options() == {}
    up = stack_config(parse("up"), str(default_model_path))
    assert (up.kv_transport, up.ucx_net_devices) == ("ucx", "eth0")
    # argparse checks no default against its choices: the config does, in one line.
    monkeypatch.setenv("EPDSERVE_KV_TRANSPORT", "UCX")
    with pytest.raises(SystemExit, match="kv_transport must be 'zmq' or 'ucx', got 'UCX'"):
        transport_config(parse("serve", "prefill"))
    with pytest.raises(SystemExit, match="kv_transport must be"):
        stack_config(parse("up"), str(default_model_path))


def test_a_killed_engine_is_reported_as_out_of_memory_with_the_options_that_help():
    message = exit_message("decode-0", -signal.SIGKILL)
    assert "out-of-memory" in message
    named = set(re.findall(r"--[a-z][a-z-]+", message))
    options = lambda *argv: {"--" + dest.replace("_", "-") for dest in vars(parse(*argv))}  # noqa: E731
    # Every option the message names exists, so that renaming one fails here rather than misleads a user.
    assert {"--kv-cache-memory", "--num-kv-blocks"} <= named <= options("serve", "decode") | options("up")
    assert "out-of-memory" in exit_message("proxy", -9) and "kv-cache" not in exit_message("proxy", -9)
    assert exit_message("prefill-1", -signal.SIGTERM) == "prefill-1 was killed by SIGTERM"
    assert exit_message("encoder-0", 1).startswith("encoder-0 exited with code 1")


def test_up_reports_a_child_killed_during_startup(tmp_path):
    class OneChild(LocalStack):
        def commands(self):
            return [("decode-0", [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])]

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit, match=r"during startup, decode-0 was killed \(SIGKILL\), probably by the "
                                             r"kernel's out-of-memory killer; .*--kv-cache-memory"):
            OneChild(StackConfig(str(tmp_path), port=free_port())).run(startup_timeout=60)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_an_unresolvable_peer_is_warned_about_once(caplog, monkeypatch):
    import asyncio
    import socket

    from epdserve.services.proxy.router import RolePool
    from epdserve.transport.channel.protocol import Role

    async def no_such_name(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    async def resolve_three_times():
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", no_such_name)
        pool = RolePool(Role.PREFILL, ["prefill:7000"], make_client=None)
        for _ in range(3):
            await pool.resolve()

    with caplog.at_level(logging.DEBUG, logger="epdserve.services.proxy.router"):
        asyncio.run(resolve_three_times())
    levels = [r.levelno for r in caplog.records if "cannot resolve" in r.getMessage()]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]


def test_every_log_level_the_deployments_allow(monkeypatch):
    import json
    from pathlib import Path

    schema = json.loads((Path(__file__).parents[2] / "helm/epdserve/values.schema.json").read_text())
    levels = schema["properties"]["config"]["properties"]["logLevel"]["enum"]
    for level in levels:  # the chart and compose pass it as $EPDSERVE_LOG_LEVEL, in capitals
        monkeypatch.setenv("EPDSERVE_LOG_LEVEL", level)
        assert parse("up").log_level == level.lower()


def test_request_traces_reach_the_proxy_from_serve_and_up(default_model_path):
    serve = ["serve", "proxy", "--decode", "d:1", "--prefill", "p:1"]
    plain = proxy_config(parse(*serve), str(default_model_path))
    assert (plain.otlp_traces_endpoint, plain.request_trace) == (None, False)  # off by default
    url = "http://127.0.0.1:4318/v1/traces"
    traced = proxy_config(parse(*serve, "--otlp-traces-endpoint", url, "--request-trace"), str(default_model_path))
    assert (traced.otlp_traces_endpoint, traced.request_trace) == (url, True)
    commands = dict(LocalStack(stack_config(parse("up", "--request-trace", "--otlp-traces-endpoint", url),
                                            str(default_model_path))).commands())
    proxy = commands.pop("proxy")
    assert proxy[proxy.index("--otlp-traces-endpoint") + 1] == url and "--request-trace" in proxy
    # Read back as the proxy reads its command line.
    assert proxy_config(parse(*proxy[proxy.index("serve"):]), str(default_model_path)).request_trace
    assert not any("--request-trace" in argv or "--otlp-traces-endpoint" in argv for argv in commands.values())
    with pytest.raises(SystemExit, match="http"):
        stack_config(parse("up", "--otlp-traces-endpoint", "collector:4317"), str(default_model_path))


def test_up_restarts_a_service_that_dies_and_gives_up_on_one_that_keeps_dying(capsys):
    """As a compose restart policy: a dead child is started again with its command line; one that died
    RESTART_LIMIT times within the window is reported and left down, and a proxy given up on stops the stack."""
    stack = LocalStack(StackConfig(model="unused"))
    crash = [sys.executable, "-c", "raise SystemExit(3)"]
    stack._argv = {"decode-0": crash, "proxy": crash}
    stack.children = [(name, stack._spawn(name)) for name in stack._argv]

    def wait_dead():
        for _, proc in stack.children:
            proc.wait(30)

    for death in range(1, launcher.RESTART_LIMIT):
        wait_dead()
        assert stack._restart_dead()
        assert "decode-0 exited with code 3 (its log lines above say why); restarting it" in capsys.readouterr().err
        assert all(proc.poll() is None or proc.returncode == 3 for _, proc in stack.children)
    wait_dead()
    assert not stack._restart_dead()  # the proxy's fifth death within the window: nothing left to serve
    err = capsys.readouterr().err
    assert f"decode-0 exited with code 3 (its log lines above say why), the {launcher.RESTART_LIMIT}th time within" \
        in err
    assert "giving up on it (the others serve without it)" in err and "giving up on it; stopping the stack" in err


SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'


@pytest.mark.parametrize("layout, speculating", [([], {"decode-0"}), (["--unified"], {"unified-0"})])
def test_up_gives_the_speculative_config_to_the_engines_that_decode(default_model_path, layout, speculating):
    from epdserve.services.cli.main import engine_config

    commands = dict(LocalStack(stack_config(parse("up", *layout, "--speculative-config", SPEC),
                                            str(default_model_path))).commands())
    for name, argv in commands.items():
        if name == "proxy":
            continue
        config = engine_config(parse(*argv[argv.index("serve"):]), str(default_model_path))
        spec = config.speculative
        assert (spec is not None) == (name in speculating), name
        if spec is not None:
            assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == \
                ("ngram", 3, 2, 2)


def test_a_prefill_given_a_draft_model_checks_it_and_loads_none(default_model_path, tmp_path, caplog):
    """Prefill samples only a request's first token: it never speculates, so a draft model given to it (as a
    deployment giving every engine the same options does) is checked but not loaded."""
    import json

    from epdserve.services.cli.main import engine_config

    model = str(default_model_path)
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 3, "model": model})
    with caplog.at_level(logging.INFO, logger="epdserve.services.cli.main"):
        assert engine_config(parse("serve", "prefill", "--speculative-config", spec), model).speculative is None
    assert "prefill does not speculate" in caplog.text
    for role in ("decode", "unified"):
        draft = engine_config(parse("serve", role, "--speculative-config", spec), model).speculative.draft
        assert draft is not None and draft.path == model
    # Checked all the same: a draft that is no model stops the prefill as it stops the decode.
    missing = json.dumps({"method": "draft_model", "num_speculative_tokens": 3, "model": str(tmp_path / "none")})
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match="speculative config"):
            engine_config(parse("serve", role, "--speculative-config", missing), model)


@pytest.mark.parametrize("value, message", [("{bad", "not valid JSON"), ('{"method": "eagle", "num_speculative_tokens": 1}',
                                                                         "speculative method"),
                                            ('{"method": "ngram", "num_speculative_tokens": 2, "x": 1}', "unsupported")])
def test_a_bad_speculative_config_stops_up_and_serve_with_one_line(default_model_path, value, message):
    from epdserve.services.cli.main import engine_config

    with pytest.raises(SystemExit, match=f"--speculative-config: .*{message}"):
        stack_config(parse("up", "--speculative-config", value), str(default_model_path))
    with pytest.raises(ValueError, match=message):
        engine_config(parse("serve", "decode", "--speculative-config", value), str(default_model_path))


def test_up_with_a_kv_store_starts_one_and_gives_every_engine_its_address(default_model_path):
    commands = dict(LocalStack(stack_config(parse("up", "--decodes", "2", "--kv-store", "0.5", "--",
                                                  "--kv-offloading-size", "2"), str(default_model_path))).commands())
    store = commands["kvstore-0"]
    assert list(commands)[0] == "kvstore-0" and store[store.index("--kv-store-size") + 1] == "0.5"
    address = f"127.0.0.1:{store[store.index('--port') + 1]}"
    for name in ("prefill-0", "decode-0", "decode-1"):
        argv = commands[name]
        serve = parse(*argv[argv.index("serve"):])
        config = service_config(serve)
        assert config.kv_store == f"tcp://{address}" and serve.kv_offloading_size == 2.0
    proxy = commands["proxy"]
    assert proxy_config(parse(*proxy[proxy.index("serve"):]), str(default_model_path)).kv_store == f"tcp://{address}"
    assert service_config(parse("serve", "kvstore", "--kv-store-size", "0.25")).kv_store_bytes == 1 << 28
    assert "kvstore-0" not in dict(LocalStack(stack_config(parse("up"), str(default_model_path))).commands())
    with pytest.raises(SystemExit, match="--kv-store must be a positive size"):
        stack_config(parse("up", "--kv-store", "0"), str(default_model_path))
    with pytest.raises(SystemExit, match="--kv-store .* is not HOST:PORT"):
        service_config(parse("serve", "decode", "--kv-store", "nowhere"))


def test_up_gives_every_engine_its_lora_options_and_the_proxy_the_adapters(tmp_path, default_model_path):
    from epdserve.services.cli.main import engine_config

    model = str(default_model_path)
    commands = dict(LocalStack(stack_config(parse(
        "up", "--encoders", "1", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--lora-modules",
        f"sql={tmp_path}/sql", f"chat={tmp_path}/chat", "--enable-lora-runtime-updates", "--lora-root", str(tmp_path),
        "--lora-root", str(default_model_path), "--max-lora-bytes", "1000"), model)).commands())
    proxy = proxy_config(parse(*commands["proxy"][commands["proxy"].index("serve"):]), model)
    assert proxy.lora_modules == (("sql", f"{tmp_path}/sql"), ("chat", f"{tmp_path}/chat"))
    assert proxy.lora_roots == (str(tmp_path), model)
    assert proxy.enable_lora_runtime_updates
    assert "--enable-lora" not in commands["encoder-0"]
    for name in ("prefill-0", "decode-0"):
        argv = commands[name]
        lora = engine_config(parse(*argv[argv.index("serve"):]), model).lora
        assert (lora.max_loras, lora.max_lora_rank) == (3, 32)
        assert lora.modules == (("sql", f"{tmp_path}/sql"), ("chat", f"{tmp_path}/chat"))
        assert (lora.roots, lora.max_bytes) == ((str(tmp_path), model), 1000)
    plain = dict(LocalStack(stack_config(parse("up"), model)).commands())
    assert not any("--enable-lora" in argv or "--lora-modules" in argv for argv in plain.values())


@pytest.mark.parametrize("argv, message", [
    (("--lora-modules", "sql"), "give NAME=PATH"),
    (("--lora-modules", "a=/x", "a=/y", "--enable-lora"), "names must be distinct"),
    (("--lora-modules", "a=/x"), "--lora-modules needs --enable-lora"),
    (("--enable-lora-runtime-updates",), "--enable-lora-runtime-updates needs --enable-lora"),
    (("--lora-root", "/"), "--lora-root needs --enable-lora"),
    (("--lora-root", "/no/such/folder", "--enable-lora"), "--lora-root '/no/such/folder' is not a folder"),
])
def test_up_refuses_bad_lora_options(default_model_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        stack_config(parse("up", *argv), str(default_model_path))


def test_up_gives_every_engine_the_budget_policy_after_the_double_dash(default_model_path, capsys):
    from epdserve.services.cli.main import engine_config

    for extra, policy in (([], "prompts"), (["--", "--budget-policy", "shared", "--max-num-batched-tokens", "2048"],
                                           "shared")):
        commands = dict(LocalStack(stack_config(parse("up", *extra), str(default_model_path))).commands())
        engines = {name: argv for name, argv in commands.items() if name.startswith(("prefill", "decode"))}
        assert engines
        for argv in engines.values():
            scheduler = engine_config(parse(*argv[argv.index("serve"):]), str(default_model_path)).scheduler
            assert scheduler.budget_policy == policy
            assert scheduler.max_num_batched_tokens == (2048 if extra else 1024)
    with pytest.raises(SystemExit, match="invalid choice: 'decode-first'"):
        parse("serve", "unified", "--budget-policy", "decode-first")


def test_services_started_from_a_folder_holding_an_epdserve_folder_run_the_installed_code(tmp_path,
                                                                                        default_model_path):
    """`python -m epdserve...` puts the working folder first on the module path: a checkout's or a user's folder
    named epdserve there must not be what `up`'s services run."""
    fake = tmp_path / "epdserve" / "services"
    fake.mkdir(parents=True)
    for folder in (fake.parent, fake):
        (folder / "__init__.py").write_text("")
    (fake / "cli.py").write_text("print('the folder epdserve ran')\n")
    stack = LocalStack(stack_config(parse("up"), str(default_model_path)))
    name, argv = stack.commands()[-1]
    done = subprocess.run([*argv[:argv.index("serve")], "serve", "proxy", "--help"], env=stack.environment(name),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "the folder epdserve ran" not in done.stdout, done.stdout + done.stderr
    assert "--reasoning-parser" in done.stdout  # the installed proxy's own help


@pytest.mark.parametrize("argv, error", [
    (["--ttft-slo", "1"], "--ttft-slo needs --planner"),
    (["--planner", "--tpot-slo", "0.05"], "--planner needs --ttft-slo above 0"),
    (["--planner", "--ttft-slo", "1", "--tpot-slo", "0"], "--planner needs --tpot-slo above 0, got 0"),
    (["--planner", "--ttft-slo", "1", "--tpot-slo", "0.05", "--unified"], "not with --unified"),
    (["--planner", "--ttft-slo", "1", "--tpot-slo", "0.05", "--planner-bounds", "unified=1:2"],
     "scales encoder, prefill, decode"),
    (["--planner", "--ttft-slo", "1", "--tpot-slo", "0.05", "--planner-bounds", "encoder=1:2"], "takes no images"),
    (["--planner", "--ttft-slo", "1", "--tpot-slo", "0.05", "--planner-profile", "/nonexistent.json"], "nonexistent"),
    (["--planner-max-instances", "3"], "--planner-max-instances needs --planner"),
    # The prefill held at one, the decodes at least two: three.
    (["--planner", "--ttft-slo", "1", "--tpot-slo", "0.05", "--planner-bounds", "decode=2:3", "--planner-max-instances",
      "2"], r"--planner-max-instances 2 is fewer than the 3 instances the bounds keep at least \(prefill=1:1,decode=2:3\)"),
])
def test_up_checks_its_planner_options(default_model_path, argv, error):
    with pytest.raises(SystemExit, match=error):
        stack_config(parse("up", *argv), str(default_model_path))


@pytest.mark.parametrize("argv, error", [
    ([], "serve planner needs --ttft-slo above 0"),
    (["--ttft-slo", "1", "--tpot-slo", "0.05"], "serve planner needs --planner-bounds"),
    (["--ttft-slo", "1", "--tpot-slo", "0.05", "--planner-bounds", "unified=1:2"], "scales encoder, prefill, decode"),
])
def test_serve_planner_checks_its_options(argv, error):
    with pytest.raises(SystemExit, match=error):
        serve_planner_config(parse("serve", "planner", "--proxy-url", "http://proxy:8000", *argv))


def test_serve_planner_scales_only_the_roles_it_is_given():
    config = serve_planner_config(parse("serve", "planner", "--proxy-url", "http://proxy:8000", "--planner-bounds",
                                        "encoder=1:3,decode=2:4", "--ttft-slo", "1", "--tpot-slo", "0.05"))
    assert config.bounds == {"encoder": (1, 3), "decode": (2, 4)} and config.interval == 10.0
    assert config.max_instances is None
    assert serve_planner_config(parse("serve", "planner", "--proxy-url", "http://proxy:8000", "--planner-bounds",
                                      "decode=2:4", "--ttft-slo", "1", "--tpot-slo", "0.05", "--planner-max-instances",
                                      "3")).max_instances == 3


@pytest.mark.parametrize("value, budget", [("5", 5), ("", None)])
def test_serve_planner_takes_its_budget_from_the_environment(monkeypatch, value, budget):
    # compose sets the variable, empty when unset: a command cannot leave the flag out.
    monkeypatch.setenv("EPDSERVE_PLANNER_MAX_INSTANCES", value)
    argv = ["serve", "planner", "--proxy-url", "http://proxy:8000", "--planner-bounds", "decode=2:4", "--ttft-slo", "1",
            "--tpot-slo", "0.05"]
    assert serve_planner_config(parse(*argv)).max_instances == budget
    assert serve_planner_config(parse(*argv, "--planner-max-instances", "2")).max_instances == 2  # the flag wins
    assert parse("up").planner_max_instances is None  # up's own planner: the flag only
    with pytest.raises(SystemExit):  # it needs the proxy
        parse("serve", "planner", "--planner-bounds", "decode=1:2")


def test_up_with_a_planner_scales_the_encoders_of_a_model_that_takes_images(llava_demo_path):
    config = stack_config(parse("up", "--planner", "--planner-bounds", "encoder=2:3,decode=1:2", "--ttft-slo", "1",
                                "--tpot-slo", "0.05"), str(llava_demo_path))
    assert config.encoders == 2  # started within the bounds
    assert config.planner.bounds == {"encoder": (2, 3), "prefill": (1, 1), "decode": (1, 2)}


def test_up_with_a_planner_starts_within_its_bounds_and_gives_the_proxy_a_discovery_file(default_model_path):
    config = stack_config(parse("up", "--decodes", "3", "--planner", "--planner-bounds", "decode=1:2", "--ttft-slo",
                                "1", "--tpot-slo", "0.05"), str(default_model_path))
    assert (config.prefills, config.decodes) == (1, 2)
    assert config.planner.bounds == {"prefill": (1, 1), "decode": (1, 2)}
    stack = LocalStack(config)
    commands = dict(stack.commands())
    proxy = proxy_config(parse(*commands["proxy"][commands["proxy"].index("serve"):]), str(default_model_path))
    listed = json.loads(Path(proxy.discovery_file).read_text())
    assert listed["decode"] == list(proxy.decodes) and len(listed["decode"]) == 2
    assert listed["prefill"] == list(proxy.prefills)
    shutil.rmtree(Path(proxy.discovery_file).parent)  # (run() removes it when the stack stops)
