"""A user's mistake on the command line ends in one line on stderr and a non-zero exit, never a traceback.

Each case runs the installed `epdserve` console script (the real entry point) in a subprocess. Model
folders here are stand-ins (a real config.json, empty weight and tokenizer files): every mistake is
caught before anything is loaded.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 16,
                "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}


def epdserve(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("epdserve")
    argv = [str(script)] if script.is_file() else [sys.executable, "-m", "epdserve.services.cli"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def model_folder(root: Path, *names: str) -> Path:
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


@pytest.fixture
def servable(tmp_path) -> Path:
    return model_folder(tmp_path, "model.safetensors", "tokenizer.json")


def test_a_missing_model_folder(tmp_path):
    done = epdserve("up", "--model", "/nonexistent/model", cwd=tmp_path)
    assert_one_line_error(done, "--model", "no model folder at '/nonexistent/model'", "epdserve model llava-demo")


def test_a_hub_id_says_models_are_local_folders_and_how_to_get_one(tmp_path):
    done = epdserve("up", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", cwd=tmp_path)
    assert_one_line_error(done, "downloads nothing",
                          "hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir")


def test_a_folder_with_only_config_json(tmp_path):
    done = epdserve("up", "--model", str(model_folder(tmp_path)), cwd=tmp_path)
    assert_one_line_error(done, "no *.safetensors weights")


def test_a_folder_without_a_tokenizer(tmp_path):
    done = epdserve("serve", "proxy", "--model", str(model_folder(tmp_path, "model.safetensors")),
                    "--decode", "127.0.0.1:7003", cwd=tmp_path)
    assert_one_line_error(done, "has no tokenizer")


def test_a_config_json_that_is_not_json(tmp_path):
    folder = model_folder(tmp_path, "model.safetensors", "tokenizer.json")
    (folder / "config.json").write_text("{not json")
    assert_one_line_error(epdserve("up", "--model", str(folder), cwd=tmp_path), "config.json is not valid JSON")


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    folder = model_folder(tmp_path, "model.safetensors", "tokenizer.json")
    (folder / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "architectures": ["GemmaForCausalLM"]}))
    assert_one_line_error(epdserve("up", "--model", str(folder), cwd=tmp_path), "unsupported architecture",
                          "GemmaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@pytest.mark.parametrize("target, message", [
    ("127.0.0.1", "'127.0.0.1' is not HOST:PORT"),
    ("127.0.0.1:99999", "port 99999 is not between 1 and 65535"),
    ("http://host:7002", "without a scheme (host:7002"),
    ("127.0.0.1:7002,prefill:", "'prefill:' is not HOST:PORT"),
])
def test_a_malformed_peer_address_is_refused_at_startup(tmp_path, servable, target, message):
    done = epdserve("serve", "proxy", "--model", str(servable), "--prefill", target, "--decode", "127.0.0.1:7003",
                    cwd=tmp_path)
    assert_one_line_error(done, "--prefill", message)


def test_a_proxy_without_decode(tmp_path, servable):
    done = epdserve("serve", "proxy", "--model", str(servable), "--prefill", "127.0.0.1:7002", cwd=tmp_path)
    assert_one_line_error(done, "at least one --decode")


def test_up_without_decodes(tmp_path, servable):
    assert_one_line_error(epdserve("up", "--model", str(servable), "--decodes", "0", cwd=tmp_path),
                          "at least one decode (--decodes)")


def test_a_missing_api_key_file(tmp_path, servable):
    done = epdserve("up", "--model", str(servable), "--api-key-file", str(tmp_path / "nope"), cwd=tmp_path)
    assert_one_line_error(done, "--api-key-file", "No such file")


def test_up_help_explains_every_option(tmp_path):
    done = epdserve("up", "--help", cwd=tmp_path)
    assert done.returncode == 0
    text = " ".join(done.stdout.split("options:", 1)[1].split())
    for option, what in [("--port PORT", "(default: 8000)"), ("--host HOST", "(default: 127.0.0.1"),
                         ("--prefills N", "(default: 1)"), ("--decodes N", "(default: 1)"),
                         ("--api-key KEY", "$EPDSERVE_API_KEY"), ("--api-key-file FILE", "$EPDSERVE_API_KEY_FILE"),
                         ("--startup-timeout SECONDS", "(default: 600.0)"), ("--log-level LEVEL", "debug")]:
        assert f"{option} " in text and what in text.split(option, 1)[1][:250], (option, text)



def test_bench_sharegpt_without_its_file(tmp_path):
    done = epdserve("bench", "serve", "--dataset-name", "sharegpt", "--port", "9", cwd=tmp_path)
    assert_one_line_error(done, "give --dataset-path", "lognormal")


def test_bench_dataset_path_with_another_dataset(tmp_path):
    done = epdserve("bench", "serve", "--dataset-path", "x.json", "--port", "9", cwd=tmp_path)
    assert_one_line_error(done, "--dataset-path is read by --dataset-name sharegpt")


@pytest.mark.parametrize("given, message", [
    (("--profile",), "--profile is not supported: it starts vLLM's torch profiler"),
    (("--dataset-name", "sonnet", "--sonnet-input-len", "550"), "--sonnet-input-len is not supported"),
    (("--backend", "openai-embeddings"), "--backend openai-embeddings is not supported"),
])
def test_bench_a_vllm_flag_it_cannot_honour(tmp_path, given, message):
    done = epdserve("bench", "serve", "--port", "9", *given, cwd=tmp_path)
    assert_one_line_error(done, message)


@pytest.mark.parametrize("option, message", [(("--max-model-len", "0"), "max_model_len must be positive"),
                                             (("--block-size", "0"), "block_size must be a positive power of two")])
def test_an_engine_option_out_of_range(tmp_path, servable, option, message):
    done = epdserve("serve", "decode", "--model", str(servable), *option, cwd=tmp_path)
    assert_one_line_error(done, message)


@pytest.mark.parametrize("given, message", [
    (("--max-modle-len", "64"), "unknown option --max-modle-len; did you mean --max-model-len"),
    (("--gpu-memory-utilisation=0.5",), "unknown option --gpu-memory-utilisation; did you mean "
                                         "--gpu-memory-utilization"),
    (("--no-such-option",), "unknown option --no-such-option (see `epdserve up --help`)"),
    (("--tensor-parallel-size", "2"), "--tensor-parallel-size 2: an engine runs on one device here"),
    (("--kv-cache-dtype", "fp8_inc"), "--kv-cache-dtype fp8_inc is not supported here; choose one of auto, "
                                      "bfloat16, fp8, fp8_e4m3, fp8_e5m2, int8"),
    (("--quantization", "awq"), "--quantization awq is not supported here; choose one of gguf, int8"),
    (("--quantization", "gguf"), "holds no GGUF file; give --model FILE.gguf"),
    (("--limit-mm-per-prompt", '{"audio": 1}'), "audio: this server takes image only"),
])
def test_a_flag_up_cannot_take_is_one_line_that_names_it(tmp_path, servable, given, message):
    done = epdserve("up", str(servable), "--port", "9", *given, cwd=tmp_path)
    assert_one_line_error(done, message)


def test_int8_quantization_of_weights_that_ship_quantized_is_refused(tmp_path):
    folder = model_folder(tmp_path, "model.safetensors", "tokenizer.json", "model.gguf")
    done = epdserve("up", str(folder), "--port", "9", "--quantization", "int8", cwd=tmp_path)
    assert_one_line_error(done, "--quantization int8:", "ships quantized weights (its GGUF file)")
