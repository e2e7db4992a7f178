"""`epdserve bench serve` takes `vllm bench serve`'s flags: a saved vLLM command line parses to the workload our
own names give, each flag with vLLM's meaning, and every vLLM flag it cannot honour is refused on one line."""
import shlex
from dataclasses import replace

import pytest

from epdserve.services.bench import datasets, vllm_flags
from epdserve.services.bench.options import BenchOptions
from epdserve.services.cli.main import build_parser

# Every flag of `vllm bench serve`, from vllm-project/vllm: vllm/benchmarks/serve.py `add_cli_args` (commit
# 009e6d4a1cd6ba3fb2a9fc00f4ec06f5297232a1) and vllm/benchmarks/datasets.py `add_dataset_parser` (commit
# 0056b87fc1fda2642f39dda4392824c425dd1638), plus --trust-remote-code, which serve.py's main reads.
VLLM_FLAGS = """
--label --backend --base-url --host --port --endpoint --header --max-concurrency --model --input-len --output-len
--tokenizer --tokenizer-mode --use-beam-search --logprobs --request-rate --burstiness --probe-request-rate
--disable-tqdm --num-warmups --profile --save-result --save-detailed --append-result --metadata --result-dir
--result-filename --ignore-eos --self-timed --percentile-metrics --metric-percentiles --goodput --request-id-prefix
--top-p --top-k --min-p --temperature --frequency-penalty --presence-penalty --repetition-penalty --served-model-name
--lora-modules --lora-assignment --ramp-up-strategy --ramp-up-start-rps --ramp-up-end-rps --ready-check-timeout-sec
--chat-template-kwargs --extra-body --skip-tokenizer-init --insecure --plot-timeline --timeline-itl-thresholds
--plot-dataset-stats --trust-remote-code
--seed --num-prompts --dataset-name --no-stream --dataset-path --no-oversample --skip-chat-template --disable-shuffle
--custom-output-len --spec-bench-output-len --spec-bench-category --sonnet-input-len --sonnet-output-len
--sonnet-prefix-len --sharegpt-output-len --blazedit-min-distance --blazedit-max-distance --random-input-len
--random-output-len --random-range-ratio --random-prefix-len --random-batch-size --no-reranker
--random-mm-base-items-per-request --random-mm-num-mm-items-range-ratio --random-mm-limit-mm-per-prompt
--txt-slices-input-len --txt-slices-output-len --random-mm-bucket-config --hf-subset --hf-split --hf-name
--hf-output-len --prefix-repetition-prefix-len --prefix-repetition-suffix-len --prefix-repetition-num-prefixes
--prefix-repetition-output-len
""".split()

# One workload, as a `vllm bench serve` script spells it and as our own names do.
SAVED_VLLM_LINE = (
    "--backend vllm --host 127.0.0.1 --port 8000 --endpoint /v1/completions --model demo --tokenizer /models/demo "
    "--dataset-name random --random-input-len 256 --random-output-len 64 --random-range-ratio 0.25 "
    "--random-prefix-len 32 --num-prompts 200 --request-rate 4 --burstiness 0.5 --max-concurrency 8 --seed 7 "
    "--ignore-eos --temperature 0 --top-p 0.9 --top-k 20 --percentile-metrics ttft,tpot,itl,e2el "
    "--metric-percentiles 50,90,99 --goodput ttft:500 tpot:50 --save-result --result-dir /tmp/results "
    "--label run1 --metadata gpu=none --disable-tqdm")
OUR_LINE = (
    "--base-url http://127.0.0.1:8000 --model demo --tokenizer /models/demo --input-len 256 --output-len 64 "
    "--random-range-ratio 0.25 --random-prefix-len 32 --num-prompts 200 --request-rate 4 --burstiness 0.5 "
    "--max-concurrency 8 --seed 7 --temperature 0 --top-p 0.9 --top-k 20 --goodput ttft:500 tpot:50 "
    "--save-result --result-dir /tmp/results --label run1 --metadata gpu=none --disable-tqdm")


def serve_parser():
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    return bench._subparsers._group_actions[0].choices["serve"]


def options(line: str | list[str]) -> BenchOptions:
    argv = shlex.split(line) if isinstance(line, str) else line
    return BenchOptions.from_args(build_parser().parse_args(["bench", "serve", *argv]))


def refusal(line: str | list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        options(line)
    return str(exc.value.code)


def test_a_saved_vllm_command_line_is_the_workload_of_our_names():
    vllm, ours = options(SAVED_VLLM_LINE), options(OUR_LINE)
    assert vllm.backend == "vllm" and ours.backend == "openai"  # what each result records
    assert replace(vllm, backend="openai") == ours
    assert (ours.base_url, ours.endpoint_path, ours.chat) == ("http://127.0.0.1:8000", "/v1/completions", False)
    assert (ours.model, ours.model_id, ours.tokenizer) == ("demo", "demo", "/models/demo")
    assert ours.body == {"temperature": 0.0, "top_p": 0.9, "top_k": 20} and ours.ignore_eos
    assert (ours.rates, ours.burstiness, ours.max_concurrency) == ((4.0,), 0.5, 8)
    assert ours.results.save_result and ours.results.metadata == {"gpu": "none"}
    # vLLM's random prompts: the shared prefix, then len * (1 -+ ratio) tokens; outputs in the same range.
    samples = datasets.sample_requests(ours.dataset, datasets.TextSource())
    assert len(samples) == 200
    assert all(32 + 192 <= s.prompt_len <= 32 + 320 and 48 <= s.expected_output_len <= 80 for s in samples)
    assert all(s.prompt.split()[:32] == samples[0].prompt.split()[:32] for s in samples)


def test_general_lengths_override_the_dataset_ones_as_in_vllm():
    config = options("--random-input-len 100 --input-len 20 --random-output-len 50 --output-len 5").dataset
    assert (config.input_len, config.output_len) == (20, 5)
    config = options("--dataset-name sharegpt --dataset-path c.json --sharegpt-output-len 50 --output-len 5").dataset
    assert config.sharegpt_output_len == 5
    config = options("").dataset
    assert (config.num_prompts, config.input_len, config.output_len, config.range_ratio) == (1000, 1024, 128, 0.0)


def test_ignore_eos_is_on_for_synthetic_prompts_only_unless_given():
    assert options("--dataset-name random").ignore_eos and options("--dataset-name image").ignore_eos
    assert not options("--dataset-name sharegpt --dataset-path c.json").ignore_eos
    assert options("--dataset-name sharegpt --dataset-path c.json --ignore-eos").ignore_eos
    assert not options("--no-ignore-eos").ignore_eos


@pytest.mark.parametrize("line, backend, path, chat", [
    ("", "openai", "/v1/completions", False),
    ("--backend vllm", "vllm", "/v1/completions", False),
    ("--backend openai-chat", "openai-chat", "/v1/chat/completions", True),
    ("--endpoint /v1/chat/completions", "openai-chat", "/v1/chat/completions", True),
    ("--dataset-name multi-turn", "openai-chat", "/v1/chat/completions", True),
    ("--backend openai --endpoint /proxy/v1/completions", "openai", "/proxy/v1/completions", False),
])
def test_backend_and_endpoint(line, backend, path, chat):
    opts = options(line)
    assert (opts.backend, opts.endpoint_path, opts.chat, opts.results.label) == (backend, path, chat, backend)


def test_model_names_as_vllm_and_a_local_folder(tmp_path):
    opts = options("--model org/big-model --served-model-name big")
    assert (opts.model, opts.model_id, opts.tokenizer, opts.tokenizer_required) == ("big", "org/big-model",
                                                                                  "org/big-model", False)
    opts = options("")  # both from the server's /v1/models, once asked
    assert (opts.model, opts.model_id, opts.tokenizer) == (None, None, None)
    opts = options(["--model", str(tmp_path)])  # a folder is no served name: the server says its own
    assert (opts.model, opts.model_id, opts.tokenizer, opts.tokenizer_required) == (None, str(tmp_path),
                                                                                  str(tmp_path), True)
    assert not options("--model demo --skip-tokenizer-init").load_tokenizer


def test_sampling_flags_and_logprobs_reach_the_request_body():
    opts = options("--min-p 0.1 --frequency-penalty 0.5 --presence-penalty 0.25 --repetition-penalty 1.1 "
                   "--logprobs 2 --extra-body '{\"top_p\": 0.5}' --top-p 0.9")
    assert opts.body == {"min_p": 0.1, "frequency_penalty": 0.5, "presence_penalty": 0.25,
                         "repetition_penalty": 1.1, "logprobs": 2, "top_p": 0.5}  # --extra-body wins, as vLLM's


def test_every_vllm_flag_is_taken_or_refused():
    known = serve_parser()._option_string_actions
    assert [flag for flag in VLLM_FLAGS if flag not in known] == []
    for flag in vllm_flags.REFUSED_FLAGS:
        message = refusal([flag, "1"])
        assert message.startswith(f"epdserve bench serve: {flag} is not supported: ") and "\n" not in message


@pytest.mark.parametrize("line, named", [
    ("--profile", "--profile"),
    ("--ramp-up-strategy linear --ramp-up-start-rps 1 --ramp-up-end-rps 8", "--ramp-up-strategy"),
    ("--lora-modules a b", "--lora-modules"),
    ("--dataset-name sonnet", "--dataset-name sonnet"),
    ("--dataset-name random-mm", "--dataset-name image"),
    ("--dataset-name nonsense", "--dataset-name 'nonsense'"),
    ("--backend openai-audio", "--backend openai-audio"),
    ("--backend openai-chat --endpoint /v1/completions", "--endpoint /v1/completions"),
    ("--backend vllm --endpoint /v1/chat/completions", "--endpoint /v1/chat/completions"),
    ("--backend openai-chat --logprobs 1", "--logprobs"),
    ("--dataset-name multi-turn --backend openai", "needs a chat endpoint"),
    ("--tokenizer-mode mistral", "--tokenizer-mode mistral"),
    ("--max-concurrency 0", "--max-concurrency"),
    ("--request-rate 0", "--request-rate"),
    ("--disable-shuffle", "--disable-shuffle"),
    ("--percentile-metrics ttft,goodput", "--percentile-metrics"),
    ("--metric-percentiles 50,p99", "--metric-percentiles"),
])
def test_what_cannot_be_honoured_is_refused_on_one_line(line, named):
    message = refusal(line)
    assert named in message and "\n" not in message, message
