"""The Grafana dashboard asks only for series a running stack exports: every PromQL query of every panel
and variable is read for the metric names and labels it uses, and each is found on the /metrics of a real
stack (an encoder, a prefill, a decode and the proxy, after one request). So does every series vLLM's own
dashboards (and vLLM production-stack's) query: they work unchanged. And what a dashboard sums counts each
thing once: summed over a scrape of every service, `vllm:num_requests_running` is the requests running, and
one request moves the request, prompt token and prefix-cache lookup counters by that one request."""
import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "epdserve" / "files" / "grafana-dashboard.json"
FUNCTIONS = {"sum", "avg", "max", "min", "count", "rate", "irate", "increase", "histogram_quantile", "label_values",
             "clamp_min", "topk"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
# Added by the scrape (compose's relabelling, the chart's ServiceMonitor), not by the services.
TARGET_LABELS = {"role", "instance", "job"}
# What the dashboard must show: vLLM's usual panels and the disaggregation's.
REQUIRED = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_params_max_tokens_bucket", "vllm:request_params_n_sum",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_inference_time_seconds_sum",
    "vllm:iteration_tokens_total_bucket", "epdserve:http_responses_total",
    "epdserve:kv_transfer_bytes_total", "epdserve:kv_transfer_seconds_total", "epdserve:kv_lease_renewals_total",
    "epdserve:kv_lease_expired_total", "epdserve:local_prefills_total", "vllm:mm_cache_hits_total",
    "vllm:mm_cache_queries_total", "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "epdserve:prompt_tokens_computed_total", "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total", "vllm:prompt_tokens_by_source_total",
    "epdserve:kv_tier_hit_tokens_total", "epdserve:kv_tier_restore_seconds_bucket",
}


def queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"])
    return exprs


def parse(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """({metric name: label names its matchers use}, label names of by/without/on/ignoring and label_values)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    selectors: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", expr):
        selectors.setdefault(name, set()).update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    grouping = {label for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr)
                for label in re.split(r"\s*,\s*", group.strip()) if label}
    label_values = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*(\w+)\s*\)\s*", expr)
    if label_values:
        return {label_values[1]: set()}, {label_values[2]}
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    for match in re.finditer(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", bare):
        token = match.group()
        if bare[match.end():].lstrip().startswith("("):
            assert token in FUNCTIONS, f"unknown function {token} in {expr}"
        elif token not in KEYWORDS:
            selectors.setdefault(token, set())
    return selectors, grouping


def test_the_parser_finds_names_and_labels():
    selectors, grouping = parse('histogram_quantile(0.99, sum by (le, role) (rate(a:b_bucket{model_name=~"$m"}'
                                '[$__rate_interval]))) / sum(rate(c_total[5m])) > bool 0')
    assert selectors == {"a:b_bucket": {"model_name"}, "c_total": set()} and grouping == {"le", "role"}
    assert parse("label_values(epdserve:x, model_name)") == ({"epdserve:x": set()}, {"model_name"})


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model_name"}
    used = set().union(*(parse(q)[0] for q in queries(dashboard)))
    assert not REQUIRED - used, f"panels missing: {REQUIRED - used}"


@pytest.fixture(scope="module")
def stack(stack_factory, demo_model):
    # Speculating engines with an offload tier export the spec_decode and kv_tier series too.
    return stack_factory(demo_model, encoders=1, prefills=1, decodes=1,
                         engine_args=["--num-kv-blocks", "128", "--max-model-len", "1024", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 2, "adaptive": false}',
                                      "--kv-offloading-size", "0.05"])


def scrape(stack) -> list:
    """Every sample of every service's /metrics, as Prometheus would scrape them."""
    return [sample for service in stack.services.values()
            for family in text_string_to_metric_families(
                httpx.get(f"http://127.0.0.1:{service.http_port}/metrics", timeout=10).text)
            for sample in family.samples]


@pytest.fixture(scope="module")
def exported(stack) -> dict[str, set[str]]:
    """{series name: label names} over every service of a running stack, after one request."""
    r = httpx.post(stack.url + "/v1/completions", json={"model": "demo", "prompt": "Hello", "max_tokens": 3},
                   timeout=120)
    assert r.status_code == 200, r.text
    series: dict[str, set[str]] = {}
    for sample in scrape(stack):
        series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_every_dashboard_query_names_series_the_stack_exports(exported):
    assert not [name for name in exported if name.endswith("_created")]
    for expr in queries(json.loads(DASHBOARD.read_text())):
        selectors, grouping = parse(expr)
        assert selectors, expr
        for name, labels in selectors.items():
            assert name in exported, f"{name} is not exported ({expr})"
            assert labels <= exported[name] | TARGET_LABELS, f"{name} has no {labels - exported[name]} ({expr})"
        on_some = set().union(*(exported[name] for name in selectors)) | TARGET_LABELS
        assert grouping <= on_some, f"no series of {expr} has {grouping - on_some}"


def test_summed_over_every_service_the_running_gauge_counts_each_running_request_once(stack):
    """As vLLM's dashboards sum `vllm:num_requests_running` over every target: with requests streaming from
    decode (each prefilled first), the sum over one scrape of the proxy, encoder, prefill and decode is the
    number of requests running, and the proxy reports them under a name of its own."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    streams = [client.completions.create(model="demo", prompt=f"Count to a thousand ({i}):", max_tokens=900,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
               for i in range(3)]
    try:
        chunks = [iter(stream) for stream in streams]
        for chunk in chunks:
            for _ in range(3):  # the first from prefill, then decode's: each request runs on decode now
                assert next(chunk).choices[0].finish_reason is None
        samples = scrape(stack)
        for chunk in chunks:  # still running after the scrape
            assert next(chunk).choices[0].finish_reason is None
    finally:
        for stream in streams:
            stream.close()
    running = {sample.labels.get("role"): sample.value for sample in samples
               if sample.name == "vllm:num_requests_running"}
    assert sum(running.values()) == len(streams), running
    assert running == {"encoder": 0, "prefill": 0, "decode": len(streams)}  # (an encoder's: the images it encodes)
    (in_flight,) = [sample.value for sample in samples if sample.name == "epdserve:proxy_requests_in_flight"]
    assert in_flight == len(streams)


# Every series vLLM's Grafana dashboards and vLLM production-stack's query, with the labels their queries
# match or group by, as read from each dashboard's JSON (the `expr` of every target, the variables' queries):
#   vllm-project/vllm examples/observability/prometheus_grafana/grafana.json (until it moved there:
#     examples/online_serving/prometheus_grafana/grafana.json)
#   vllm-project/vllm examples/observability/dashboards/grafana/vllm_overview.json
#   vllm-project/production-stack helm/dashboards/vllm-model-metrics-dashboard.json
#   vllm-project/production-stack helm/dashboards/vllm-dashboard.json
# Their variables read `label_values(model_name)`, and the overview's `job` and `instance` come from the
# scrape. Left out, not being vLLM's engine series: production-stack's router's own (its vllm-dashboard.json's
# `vllm:healthy_pods_total`, `vllm:current_qps` and `router_*`), the deprecated `vllm:gpu_prefix_cache_*`
# that vLLM stopped exporting after 0.9 (the same panel there), and the HTTP server's instrumentation that
# vllm_overview.json shows (`http_requests_total`, `http_request_duration_seconds`: the proxy counts its API
# responses by status in epdserve:http_responses_total).
VLLM_DASHBOARD_SERIES = {
    "vllm:e2e_request_latency_seconds_bucket": {"model_name", "le"},
    "vllm:e2e_request_latency_seconds_sum": {"model_name"},
    "vllm:e2e_request_latency_seconds_count": {"model_name"},
    "vllm:time_to_first_token_seconds_bucket": {"model_name", "le"},
    "vllm:time_to_first_token_seconds_sum": {"model_name"},
    "vllm:time_to_first_token_seconds_count": {"model_name"},
    "vllm:inter_token_latency_seconds_bucket": {"model_name", "le"},
    "vllm:inter_token_latency_seconds_sum": {"model_name"},
    "vllm:inter_token_latency_seconds_count": {"model_name"},
    "vllm:request_time_per_output_token_seconds_bucket": {"model_name", "le"},
    "vllm:request_time_per_output_token_seconds_sum": {"model_name"},
    "vllm:request_time_per_output_token_seconds_count": {"model_name"},
    "vllm:prompt_tokens_total": {"model_name"},
    "vllm:generation_tokens_total": {"model_name"},
    "vllm:request_success_total": {"model_name", "finished_reason"},
    "vllm:request_prompt_tokens_bucket": {"model_name", "le"},
    "vllm:request_prompt_tokens_sum": {"model_name"},
    "vllm:request_prompt_tokens_count": {"model_name"},
    "vllm:request_generation_tokens_bucket": {"model_name", "le"},
    "vllm:request_generation_tokens_sum": {"model_name"},
    "vllm:request_generation_tokens_count": {"model_name"},
    "vllm:request_max_num_generation_tokens_sum": {"model_name"},
    "vllm:num_requests_running": {"model_name"},
    "vllm:num_requests_waiting": {"model_name"},
    "vllm:num_requests_waiting_by_reason": {"model_name", "reason"},
    "vllm:kv_cache_usage_perc": {"model_name"},
    "vllm:num_preemptions_total": {"model_name"},
    "vllm:prefix_cache_hits_total": {"model_name"},
    "vllm:prefix_cache_queries_total": {"model_name"},
    "vllm:external_prefix_cache_hits_total": {"model_name"},
    "vllm:external_prefix_cache_queries_total": {"model_name"},
    "vllm:mm_cache_hits_total": {"model_name"},
    "vllm:mm_cache_queries_total": {"model_name"},
    "vllm:prompt_tokens_by_source_total": {"model_name", "source"},
    "vllm:iteration_tokens_total_bucket": {"model_name", "le"},
    "vllm:iteration_tokens_total_sum": {"model_name"},
    "vllm:iteration_tokens_total_count": {"model_name"},
    "vllm:request_queue_time_seconds_bucket": {"model_name", "le"},
    "vllm:request_queue_time_seconds_sum": {"model_name"},
    "vllm:request_queue_time_seconds_count": {"model_name"},
    "vllm:request_prefill_time_seconds_sum": {"model_name"},
    "vllm:request_prefill_time_seconds_count": {"model_name"},
    "vllm:request_decode_time_seconds_sum": {"model_name"},
    "vllm:request_decode_time_seconds_count": {"model_name"},
}


def test_every_series_vllms_dashboards_query_is_exported(exported):
    missing = {name: labels - exported.get(name, set()) for name, labels in VLLM_DASHBOARD_SERIES.items()
               if name not in exported or not labels <= exported[name]}
    assert not missing, f"series (or their labels) vLLM's dashboards query and the stack lacks: {missing}"
    # The engines' series carry vLLM's own labels: the model's name and the engine's index in its server.
    engine_series = [name for name in exported if name.startswith("vllm:num_requests")]
    assert engine_series and all({"model_name", "engine"} <= exported[name] for name in engine_series)


def totals(stack) -> dict[str, float]:
    """{series: value summed over every service of the stack and every label}."""
    out: dict[str, float] = {}
    for sample in scrape(stack):
        out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_one_request_counts_once_summed_over_every_service(stack):
    """One request prefilled on prefill and decoded on decode: the request, its prompt tokens and its prompt's
    prefix-cache lookup are counted once over the proxy, encoder, prefill and decode (decode looks the prompt
    up in its own cache too, to pull less: that lookup is not counted), and so are its stage times."""
    before = totals(stack)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="demo", prompt="Once counted, twice shy: a proverb of", max_tokens=6,
                                    temperature=0, extra_body={"ignore_eos": True})
    after = totals(stack)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    prompt = out.usage.prompt_tokens
    assert delta["epdserve:remote_kv_requests_total"] == 1  # prefill computed it, decode pulled it
    assert delta["vllm:request_success_total"] == 1
    assert delta["vllm:prompt_tokens_total"] == prompt
    assert delta["vllm:generation_tokens_total"] == 6
    assert delta["vllm:prefix_cache_queries_total"] == prompt
    assert delta["vllm:external_prefix_cache_queries_total"] == prompt  # the engines have offload tiers
    assert delta["vllm:prompt_tokens_by_source_total"] == prompt
    assert delta["vllm:prompt_tokens_cached_total"] == out.usage.prompt_tokens_details.cached_tokens
    assert delta["vllm:prefix_cache_hits_total"] + delta["vllm:external_prefix_cache_hits_total"] == \
        out.usage.prompt_tokens_details.cached_tokens
    for stage in ("queue", "prefill", "decode", "inference"):
        assert delta[f"vllm:request_{stage}_time_seconds_count"] == 1, stage
    assert delta["vllm:e2e_request_latency_seconds_count"] == delta["vllm:time_to_first_token_seconds_count"] == 1
