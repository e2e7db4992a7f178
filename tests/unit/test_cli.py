"""The command line builds the configs the services receive."""
import pytest

from epdserve.services.cli import build_parser, proxy_config, service_config


def parse(*argv):
    return build_parser().parse_args(list(argv))


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


def test_proxy_needs_a_way_to_decode(default_model_path):
    with pytest.raises(ValueError, match="decode"):
        proxy_config(parse("serve", "proxy", "--prefill", "p:1"), str(default_model_path))


def test_service_config_from_args():
    args = parse("serve", "prefill", "--host", "0.0.0.0", "--port", "7000", "--data-port", "7100",
                 "--lease-seconds", "3", "--kv-backend", "zmq")
    config = service_config(args)
    assert (config.role, config.host, config.port, config.data_port, config.lease_seconds) == \
        ("prefill", "0.0.0.0", 7000, 7100, 3.0)
    assert config.engine_id.startswith("prefill-")
