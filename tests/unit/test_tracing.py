"""A request's trace as the proxy assembles it (services/proxy/tracing.py) and as the services record their
part (services/host/request_spans.py); exported through the real OpenTelemetry SDK, into its in-memory exporter
and, over OTLP/HTTP, to a receiver on 127.0.0.1 that decodes the protobuf with opentelemetry-proto."""
import http.server
import logging
import threading
import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from epdserve.services.proxy.metrics import ProxyMetrics
from epdserve.services.proxy.tracing import (OTelExport, RequestTrace, Tracer, check_otlp_endpoint, stage_of,
                                             trace_id_of)
from epdserve.services.host.request_spans import RequestSpans, unix_time
from epdserve.shared.engine.outputs import RequestMetrics
from epdserve.transport.channel.protocol import TraceSpan

T0 = 1_700_000_000.0
RID = "chatcmpl-1.abc"


def disaggregated_trace() -> RequestTrace:
    """What a prefill -> decode request's trace holds, the services' spans arriving out of order."""
    trace = RequestTrace(RID, "proxy-8000", start=T0, model_name="demo")
    trace.add_own("proxy.prefill", T0 + 0.010, T0 + 0.120)
    trace.add([TraceSpan("prefill.compute", "prefill-0", T0 + 0.030, T0 + 0.110),
               TraceSpan("prefill.queue", "prefill-0", T0 + 0.012, T0 + 0.030)])
    trace.add_own("proxy.first_token", T0, T0 + 0.121)
    trace.add([TraceSpan("decode.queue", "decode-0", T0 + 0.125, T0 + 0.126),
               TraceSpan("kv.transfer", "decode-0", T0 + 0.126, T0 + 0.131, num_bytes=3 * 4096, num_blocks=3),
               TraceSpan("decode.first_step", "decode-0", T0 + 0.131, T0 + 0.150)])
    return trace


def test_the_trace_is_the_whole_request_then_its_spans_by_start():
    trace = disaggregated_trace()
    trace.end = T0 + 0.400
    names = [s.name for s in trace.spans()]
    assert names == ["proxy.request", "proxy.first_token", "proxy.prefill", "prefill.queue", "prefill.compute",
                     "decode.queue", "kv.transfer", "decode.first_step"]
    out = trace.breakdown()
    assert (out["request_id"], out["model"]) == (RID, "demo")
    root, transfer = out["spans"][0], out["spans"][6]
    assert (root["engine_id"], root["start"], root["duration_ms"]) == ("proxy-8000", T0, pytest.approx(400.0))
    assert (transfer["num_bytes"], transfer["num_blocks"], transfer["duration_ms"]) == (12288, 3, pytest.approx(5.0))
    assert "kv.transfer 5.0ms@decode-0 12288B/3 blocks" in trace.summary()


def test_finish_fixes_the_end_once():
    trace = RequestTrace(RID, "proxy", start=time.time())
    trace.finish()
    end = trace.end
    trace.finish("too late")
    assert trace.end == end and trace.error is None
    assert trace.spans()[0].end == end


def test_a_closed_trace_is_logged_and_observed_per_stage_once(caplog):
    metrics = ProxyMetrics("demo")
    tracer = Tracer("proxy-8000", metrics.observe_stage)
    trace = disaggregated_trace()
    trace.add([TraceSpan("kv.recompute:blocks_not_found", "decode-0", T0 + 0.2, T0 + 0.3)])
    with caplog.at_level(logging.DEBUG, logger="epdserve.services.proxy.tracing"):
        tracer.close(trace)
        tracer.close(trace)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"request {RID} trace: proxy.request ") and "kv.recompute:blocks_not_found 100.0ms" in line
    text = metrics.render()[0].decode()
    count = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("epdserve:request_stage_seconds_count")}
    assert count['model_name="demo",stage="kv.transfer"'] == 1
    assert count['model_name="demo",stage="proxy.request"'] == 1
    assert count['model_name="demo",stage="kv.recompute"'] == 1  # the stage, without the reason


def test_stage_names_and_trace_ids():
    assert stage_of("kv.recompute:no_room") == "kv.recompute" and stage_of("kv.transfer") == "kv.transfer"
    assert trace_id_of(RID) == trace_id_of(RID) != trace_id_of(RID + "x")
    assert 0 < trace_id_of(RID) < 1 << 128


def test_otel_export_is_one_trace_per_request_with_the_root_as_every_spans_parent():
    exporter = InMemorySpanExporter()
    export = OTelExport(exporter, batch=False)
    try:
        trace = disaggregated_trace()
        trace.add([TraceSpan("kv.recompute:blocks_not_found", "decode-0", T0 + 0.2, T0 + 0.3)])
        trace.finish("no tokens from decode-0 for 600s")
        export.export(trace)
        other = RequestTrace("cmpl-2.def", "proxy-8000", start=T0)
        other.finish()
        export.export(other)
    finally:
        export.shutdown()
    spans = exporter.get_finished_spans()
    mine = [s for s in spans if s.context.trace_id == trace_id_of(RID)]
    assert len(mine) == 9 and len(spans) == 10
    root = next(s for s in mine if s.name == "proxy.request")
    assert root.parent is None and root.status.status_code is StatusCode.ERROR
    assert root.start_time == int(T0 * 1e9) and root.attributes["epdserve.request_id"] == RID
    assert root.resource.attributes["service.name"] == "epdserve-proxy"
    assert root.attributes["gen_ai.response.model"] == "demo"
    children = [s for s in mine if s is not root]
    assert all(s.parent.span_id == root.context.span_id for s in children)
    by_name = {s.name: s for s in children}
    transfer = by_name["kv.transfer"]
    assert transfer.attributes["epdserve.engine_id"] == "decode-0"
    assert (transfer.attributes["epdserve.num_bytes"], transfer.attributes["epdserve.num_blocks"]) == (12288, 3)
    assert transfer.end_time - transfer.start_time == pytest.approx(5e6, abs=1e3)
    assert by_name["kv.recompute"].attributes["epdserve.reason"] == "blocks_not_found"
    assert "epdserve.num_bytes" not in by_name["prefill.queue"].attributes


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP traces receiver: keeps each POST's body and path, answers 200."""

    received: list[tuple[str, str, bytes]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_otlp_http_export_reaches_a_receiver_as_protobuf():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Receiver.received = []
    try:
        export = OTelExport.otlp(f"http://127.0.0.1:{server.server_address[1]}/v1/traces")
        trace = disaggregated_trace()
        trace.finish()
        export.export(trace)
        export.shutdown()  # flushes the batch
    finally:
        server.shutdown()
        server.server_close()
    assert [(path, kind) for path, kind, _ in _Receiver.received] == [("/v1/traces", "application/x-protobuf")]
    request = ExportTraceServiceRequest.FromString(_Receiver.received[0][2])
    spans = [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
    assert len(spans) == 8
    assert {span.trace_id for span in spans} == {trace_id_of(RID).to_bytes(16, "big")}
    root = next(span for span in spans if span.name == "proxy.request")
    assert not root.parent_span_id
    transfer = next(span for span in spans if span.name == "kv.transfer")
    assert transfer.parent_span_id == root.span_id
    attributes = {a.key: a.value for a in transfer.attributes}
    assert attributes["epdserve.num_bytes"].int_value == 12288
    assert attributes["epdserve.request_id"].string_value == RID


def test_the_endpoint_must_be_an_http_url():
    check_otlp_endpoint("http://collector:4318/v1/traces")
    with pytest.raises(ValueError, match="http"):
        check_otlp_endpoint("collector:4317")


def test_a_service_records_its_engine_stages_in_unix_time():
    now = time.monotonic()
    spans = RequestSpans("prefill-0")
    spans.add_engine_stages(RequestMetrics(now - 0.3, first_scheduled_time=now - 0.2, first_token_time=now - 0.05))
    spans.add("embeddings.fetch", now - 0.4, now - 0.35, num_bytes=1024)
    queue, compute, fetch = spans.take()
    assert (queue.name, compute.name, fetch.name) == ("prefill.queue", "prefill.compute", "embeddings.fetch")
    assert queue.start == pytest.approx(time.time() - 0.3, abs=0.05) and queue.end == pytest.approx(compute.start)
    assert compute.end - compute.start == pytest.approx(0.15) and fetch.num_bytes == 1024
    assert {s.engine_id for s in (queue, compute, fetch)} == {"prefill-0"}
    assert spans.take() == ()  # handed over once: only a request's first delta carries them
    spans.add_engine_stages(RequestMetrics(now))  # never scheduled here: nothing to say
    assert spans.take() == () and unix_time(now) == pytest.approx(time.time(), abs=0.05)
