"""The proxy's image downloads against a real HTTP server on 127.0.0.1: limits, and the guards that
keep a client from using the proxy to reach hosts it could not reach itself."""
import asyncio
import http.server
import ipaddress
import threading

import pytest

from epdserve.services.proxy.images import ImageFetcher, is_public
from epdserve.services.proxy.serving import BadRequest

PICTURE = bytes(range(256)) * 64


class _Handler(http.server.BaseHTTPRequestHandler):
    hosts_seen: list[str] = []

    def do_GET(self):
        _Handler.hosts_seen.append(self.headers["Host"])
        port = self.server.server_address[1]
        if self.path == "/picture":
            self._answer(200, PICTURE)
        elif self.path == "/to-ip":  # a hop onto another host name of the same server
            self._answer(302, b"", Location=f"http://127.0.0.1:{port}/picture")
        elif self.path == "/relative":
            self._answer(302, b"", Location="/picture")
        elif self.path == "/loop":
            self._answer(302, b"", Location="/loop")
        else:
            self._answer(404, b"")

    def _answer(self, status, body, **headers):
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def fetch(fetcher: ImageFetcher, url: str) -> bytes:
    return asyncio.run(fetcher.fetch(url))


def test_loopback_hosts_are_refused_by_default(port):
    for host in ("127.0.0.1", "localhost", "[::1]", "0.0.0.0"):
        with pytest.raises(BadRequest, match="non-public address|does not resolve"):
            fetch(ImageFetcher(), f"http://{host}:{port}/picture")


def test_private_hosts_allowed_on_request(port):
    fetcher = ImageFetcher(allow_private=True)
    assert fetch(fetcher, f"http://127.0.0.1:{port}/picture") == PICTURE
    _Handler.hosts_seen.clear()
    assert fetch(fetcher, f"http://localhost:{port}/relative") == PICTURE
    # The connection goes to the checked address, but the server still sees the URL's host name.
    assert _Handler.hosts_seen == [f"localhost:{port}"] * 2


def test_domain_allow_list_is_checked_on_every_redirect_hop(port):
    fetcher = ImageFetcher(allow_private=True, allowed_domains=("localhost",))
    assert fetch(fetcher, f"http://localhost:{port}/picture") == PICTURE
    with pytest.raises(BadRequest, match="127.0.0.1 is not an allowed image domain"):
        fetch(fetcher, f"http://localhost:{port}/to-ip")
    with pytest.raises(BadRequest, match="127.0.0.1 is not an allowed image domain"):
        fetch(fetcher, f"http://127.0.0.1:{port}/picture")


def test_limits_and_bad_answers_are_client_errors(port):
    fetcher = ImageFetcher(allow_private=True)
    with pytest.raises(BadRequest, match="redirected more than 3 times"):
        fetch(fetcher, f"http://127.0.0.1:{port}/loop")
    with pytest.raises(BadRequest, match="HTTP 404"):
        fetch(fetcher, f"http://127.0.0.1:{port}/missing")
    with pytest.raises(BadRequest, match="larger than 1000 bytes"):
        fetch(ImageFetcher(max_bytes=1000, allow_private=True), f"http://127.0.0.1:{port}/picture")
    with pytest.raises(BadRequest, match="does not resolve"):
        fetch(fetcher, "http://no-such-host.invalid/picture")
    with pytest.raises(BadRequest, match="data: URL or an http"):
        fetch(fetcher, "file:///etc/passwd")


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("::1", False), ("fe80::1", False), ("fd00::1", False), ("::ffff:127.0.0.1", False), ("::ffff:8.8.8.8", True),
])
def test_public_addresses(address, public):
    assert is_public(ipaddress.ip_address(address)) is public
