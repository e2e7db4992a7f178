"""Speculative decoding served: a unified engine and 1 prefill + 1 decode (ngram; and a draft model), each
engine speculating with --speculative-config, answer exactly what the offline engine answers without
speculation - greedy (and that is HF's), seeded, with a JSON schema, with n > 1, streamed - while the
decode (or unified) engine accepts draft tokens, as its spec_decode metrics show."""
import json

import jsonschema
import openai
import pytest

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": false}'
LAYOUTS = {"unified": dict(unified=1), "1p1d": dict(prefills=1, decodes=1),
           "1p1d-draft-model": dict(prefills=1, decodes=1)}
TEXT = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "Rewrite the code above, word for word:\n\ndef add(a, b):\n")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def stack(request, stack_factory, default_model_path):
    # The draft model layout drafts with the model itself: what is tested is the serving path, and every
    # greedy draft is accepted.
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 3, "model": str(default_model_path),
                       "adaptive": False}) \
        if request.param.endswith("draft-model") else SPEC
    stack = stack_factory(default_model_path, engine_args=["--num-kv-blocks", "256", "--speculative-config", spec],
                          **LAYOUTS[request.param])
    yield stack
    stack.stop()  # one stack at a time


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(default_model_path):
    """The offline engine without speculation."""
    from epdserve import LLM

    return LLM(default_model_path, num_kv_blocks=128)


@pytest.fixture(scope="module")
def prompt_ids(reference):
    return reference.get_tokenizer().encode(TEXT)


def speculating(stack):
    return stack.services["decode-0" if "decode-0" in stack.services else "unified-0"]


def accepted(stack) -> float:
    return speculating(stack).metrics().get("vllm:spec_decode_num_accepted_tokens_total", 0.0)


def offline(reference, prompt_ids, **params):
    from epdserve import SamplingParams

    return [c.token_ids for c in reference.generate({"prompt_token_ids": prompt_ids},
                                                    SamplingParams(**params))[0].outputs]


def served(client, prompt_ids, ids_of, **params):
    out = client.completions.create(model="demo", prompt=prompt_ids, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True, **params.pop("extra", {})},
                                    **params)
    return [ids_of(c.logprobs.tokens) for c in sorted(out.choices, key=lambda c: c.index)]


def test_greedy_is_one_token_per_step_and_hf(stack, client, reference, prompt_ids, ids_of, default_model_path,
                                             hf_causal_lm, hf_greedy, near_tie_check):
    before = accepted(stack)
    got = served(client, prompt_ids, ids_of, max_tokens=32, temperature=0, extra={"ignore_eos": True})[0]
    assert accepted(stack) > before
    model = hf_causal_lm(default_model_path)
    assert near_tie_check("served", got, *hf_greedy(model, prompt_ids, 32)) == 0
    assert got == offline(reference, prompt_ids, temperature=0, max_tokens=32, ignore_eos=True)[0]


@pytest.mark.parametrize("params", [dict(temperature=1.0, seed=7, max_tokens=32),
                                    dict(temperature=0.8, top_p=0.9, seed=3, max_tokens=32, n=2)])
def test_seeded_sampling_and_n_are_one_token_per_step(stack, client, reference, prompt_ids, ids_of, params):
    before = accepted(stack)
    extra = {"ignore_eos": True}
    assert served(client, prompt_ids, ids_of, **params, extra=extra) == \
        offline(reference, prompt_ids, **params, **extra)
    assert accepted(stack) > before


def test_json_schema_is_one_token_per_step(stack, client, reference, prompt_ids, ids_of):
    from epdserve.shared.engine.sampling_params import StructuredOutputsParams

    ask = reference.get_tokenizer().encode('Repeat: {"name": "ann", "tags": ["x", "x", "x"]} and again: ')
    for params in (dict(temperature=0.0, max_tokens=60), dict(temperature=1.0, seed=4, max_tokens=60)):
        got = served(client, ask, ids_of, **params, extra={"guided_json": SCHEMA})[0]
        want = offline(reference, ask, **params, structured_outputs=StructuredOutputsParams.json_schema(SCHEMA))[0]
        assert got == want
        jsonschema.validate(json.loads(reference.get_tokenizer().decode(got)), SCHEMA)


def test_streaming_reassembles_to_the_same_text(client, prompt_ids):
    whole = client.completions.create(model="demo", prompt=prompt_ids, max_tokens=40, temperature=0)
    parts, chunks = [], 0
    for chunk in client.completions.create(model="demo", prompt=prompt_ids, max_tokens=40, temperature=0,
                                           stream=True):
        chunks += 1
        parts.append(chunk.choices[0].text if chunk.choices else "")
    assert "".join(parts) == whole.choices[0].text
    # Accepted drafts arrive together: fewer chunks than tokens.
    assert chunks < whole.usage.completion_tokens


def test_stop_string_cuts_inside_an_accepted_run(client, prompt_ids):
    whole = client.completions.create(model="demo", prompt=prompt_ids, max_tokens=40, temperature=0).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    cut = client.completions.create(model="demo", prompt=prompt_ids, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[:whole.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_every_engine_is_given_the_config_and_only_the_decoding_one_speculates(stack):
    """The stacks give every engine --speculative-config: the prefill checks it and loads no draft (its part of
    a request ends at the first token); the decoding engine loads the draft model, given one."""
    engines = [s for s in stack.services.values() if s.role in ("prefill", "decode", "unified")]
    drafting = speculating(stack)
    for engine in engines:
        log = engine.log.read_text()
        assert "--speculative-config" in engine.argv
        assert ("vllm:spec_decode_num_drafts_total" in engine.metrics()) == (engine is drafting), engine.name
        if engine is not drafting:
            assert "prefill does not speculate" in log and "loading it for speculative decoding" not in log
    loads_draft = "loading it for speculative decoding" in drafting.log.read_text()
    assert loads_draft == ("draft_model" in drafting.argv[drafting.argv.index("--speculative-config") + 1])
