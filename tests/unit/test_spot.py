"""Spot / preemption notices (ckptd.adapters.cloud.spot) against a fake instance-metadata
server on 127.0.0.1 that serves exactly what the clouds serve, switchable per provider
between "no notice" and "notice":

- AWS: ``PUT /latest/api/token`` (IMDSv2) hands out a token that ``GET
  /latest/meta-data/spot/instance-action`` must carry (401 otherwise); 404 while nothing is
  planned, 200 with ``{"action", "time"}`` on a notice;
- GCP: ``GET /computeMetadata/v1/instance/preempted`` answers ``FALSE``/``TRUE`` only with
  ``Metadata-Flavor: Google`` (403 otherwise);
- Azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` answers only with
  ``Metadata: true`` (400 otherwise); a ``Preempt`` event is a notice, a ``Freeze`` is not.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from ckptd.adapters.cloud.spot import DEFAULT_URLS, SpotSource, SpotWatcher, check, sources_from

AWS_PATH = "/latest/meta-data/spot/instance-action"
AWS_TOKEN_PATH = "/latest/api/token"
GCP_PATH = "/computeMetadata/v1/instance/preempted"
AZURE_PATH = "/metadata/scheduledevents"
AZURE_QUERY = "api-version=2020-07-01"

AWS_NOTICE = {"action": "terminate", "time": "2026-11-22T13:30:00Z"}
AZURE_PREEMPT = {
    "EventId": "x", "EventType": "Preempt", "ResourceType": "VirtualMachine",
    "Resources": ["vm"], "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2026 18:29:47 GMT",
}
AZURE_FREEZE = {**AZURE_PREEMPT, "EventId": "y", "EventType": "Freeze"}


@dataclass
class MetadataState:
    """What the fake serves now, and what it saw."""

    aws_notice: bool = False
    aws_v1_only: bool = False
    """The token endpoint refuses (403), and GETs without a token are served (IMDSv1)."""
    gcp_notice: bool = False
    azure_events: list[dict[str, Any]] = field(default_factory=list)
    tokens: set[str] = field(default_factory=set)
    token_ttls: list[str] = field(default_factory=list)
    aws_get_tokens: list[str | None] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    override: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    """Path (without query) -> (status, body) served instead, once headers are right."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeMetadata:
    def __init__(self) -> None:
        self.state = MetadataState()
        state = self.state

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                del format, args

            def _send(self, status: int, body: bytes = b"", ctype: str = "text/plain") -> None:
                path = urlsplit(self.path).path
                if status == 200 and path in state.override:
                    status, body = state.override[path]
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                with state.lock:
                    state.requests.append(("PUT", self.path))
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if self.path != AWS_TOKEN_PATH:
                    self._send(404)
                    return
                if state.aws_v1_only:
                    self._send(403)
                    return
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                if not ttl or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    self._send(400)
                    return
                token = secrets.token_urlsafe(24)
                with state.lock:
                    state.tokens.add(token)
                    state.token_ttls.append(ttl)
                self._send(200, token.encode())

            def do_GET(self) -> None:
                with state.lock:
                    state.requests.append(("GET", self.path))
                url = urlsplit(self.path)
                if url.path == AWS_PATH:
                    self._aws()
                elif url.path == GCP_PATH:
                    self._gcp()
                elif url.path == AZURE_PATH:
                    self._azure(url.query)
                else:
                    self._send(404)

            def _aws(self) -> None:
                token = self.headers.get("X-aws-ec2-metadata-token")
                with state.lock:
                    state.aws_get_tokens.append(token)
                    valid = token in state.tokens
                if not state.aws_v1_only and not valid:
                    self._send(401)
                    return
                if not state.aws_notice and AWS_PATH not in state.override:
                    self._send(404, b"<?xml ?><Error>Not Found</Error>", "text/html")
                    return
                self._send(200, json.dumps(AWS_NOTICE).encode(), "text/plain")

            def _gcp(self) -> None:
                if self.headers.get("Metadata-Flavor") != "Google":
                    self._send(403, b"Missing Metadata-Flavor:Google header.")
                    return
                self._send(200, b"TRUE" if state.gcp_notice else b"FALSE",
                           "application/text")

            def _azure(self, query: str) -> None:
                if self.headers.get("Metadata") != "true":
                    self._send(400, b'{"error": "Bad request. Required metadata header '
                                    b'not specified"}', "application/json")
                    return
                if parse_qs(query).get("api-version") != ["2020-07-01"]:
                    self._send(400, b'{"error": "Bad request. api-version invalid"}',
                               "application/json")
                    return
                doc = {"DocumentIncarnation": 1, "Events": list(state.azure_events)}
                self._send(200, json.dumps(doc).encode(), "application/json")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       args=(0.05,), name="fake-imds", daemon=True)
        self.thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def source(self, provider: str) -> SpotSource:
        path = {"aws": AWS_PATH, "gcp": GCP_PATH, "azure": f"{AZURE_PATH}?{AZURE_QUERY}"}
        return SpotSource(provider, self.base + path[provider])

    def set_notice(self, provider: str, on: bool) -> None:
        with self.state.lock:
            if provider == "aws":
                self.state.aws_notice = on
            elif provider == "gcp":
                self.state.gcp_notice = on
            else:
                self.state.azure_events = [dict(AZURE_PREEMPT)] if on else []

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def imds() -> Iterator[FakeMetadata]:
    fake = FakeMetadata()
    try:
        yield fake
    finally:
        fake.close()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, provider: str, detail: str) -> None:
        self.calls.append((provider, detail))


# ---- check(), per provider ----------------------------------------------------------------


def test_aws_no_notice_is_none_and_the_get_carries_the_imdsv2_token(
    imds: FakeMetadata,
) -> None:
    assert check(imds.source("aws")) is None
    st = imds.state
    assert ("PUT", AWS_TOKEN_PATH) in st.requests, "no IMDSv2 token was asked for"
    assert st.token_ttls and all(t.isdigit() for t in st.token_ttls)
    assert st.aws_get_tokens, "instance-action was never fetched"
    assert all(t in st.tokens for t in st.aws_get_tokens), (
        f"the GET must carry the token the PUT handed out: got {st.aws_get_tokens}, "
        f"handed out {st.tokens}"
    )
    # the token is asked for before the GET that uses it
    assert st.requests.index(("PUT", AWS_TOKEN_PATH)) < st.requests.index(("GET", AWS_PATH))


def test_aws_notice_gives_the_action_and_time(imds: FakeMetadata) -> None:
    imds.set_notice("aws", True)
    detail = check(imds.source("aws"))
    assert detail is not None
    assert "terminate" in detail and "2026-11-22T13:30:00Z" in detail, detail
    assert imds.state.aws_get_tokens
    assert all(t in imds.state.tokens for t in imds.state.aws_get_tokens)


def test_aws_falls_back_to_imdsv1_when_the_token_endpoint_refuses(imds: FakeMetadata) -> None:
    imds.state.aws_v1_only = True
    assert check(imds.source("aws")) is None
    imds.set_notice("aws", True)
    detail = check(imds.source("aws"))
    assert detail is not None and "terminate" in detail
    assert imds.state.aws_get_tokens and all(t is None for t in imds.state.aws_get_tokens)


def test_gcp_both_ways_with_the_metadata_flavor_header(imds: FakeMetadata) -> None:
    assert check(imds.source("gcp")) is None
    imds.set_notice("gcp", True)
    assert check(imds.source("gcp")) == "preempted"
    imds.set_notice("gcp", False)
    assert check(imds.source("gcp")) is None
    # the fake does refuse a request without the header (so check() must have sent it)
    assert _status(imds.source("gcp").url, {}) == 403


def test_azure_both_ways_with_the_metadata_header(imds: FakeMetadata) -> None:
    assert check(imds.source("azure")) is None
    imds.set_notice("azure", True)
    detail = check(imds.source("azure"))
    assert detail is not None
    assert "Preempt" in detail and "Mon, 19 Sep 2026 18:29:47 GMT" in detail, detail
    imds.set_notice("azure", False)
    assert check(imds.source("azure")) is None
    assert _status(imds.source("azure").url, {}) == 400


def test_azure_freeze_event_is_not_a_notice(imds: FakeMetadata) -> None:
    imds.state.azure_events = [dict(AZURE_FREEZE)]
    assert check(imds.source("azure")) is None
    # a Freeze next to a Preempt: the Preempt counts
    imds.state.azure_events = [dict(AZURE_FREEZE), dict(AZURE_PREEMPT)]
    detail = check(imds.source("azure"))
    assert detail is not None and "Preempt" in detail


def _status(url: str, headers: dict[str, str]) -> int:
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


# ---- SpotWatcher.poll_once ----------------------------------------------------------------


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_watcher_fires_once_per_notice_and_again_after_it_came_back(
    imds: FakeMetadata, provider: str
) -> None:
    seen = Recorder()
    watcher = SpotWatcher([imds.source(provider)], seen, interval_s=60)

    assert watcher.poll_once() == []
    assert seen.calls == []

    imds.set_notice(provider, True)
    assert watcher.poll_once() == [provider]
    assert len(seen.calls) == 1 and seen.calls[0][0] == provider
    assert seen.calls[0][1], "the detail is empty"

    for _ in range(3):  # the notice persists: not again
        assert watcher.poll_once() == []
    assert len(seen.calls) == 1

    imds.set_notice(provider, False)
    assert watcher.poll_once() == []
    assert len(seen.calls) == 1

    imds.set_notice(provider, True)  # cleared and came back: a new notice
    assert watcher.poll_once() == [provider]
    assert len(seen.calls) == 2
    assert watcher.poll_once() == []
    assert len(seen.calls) == 2


def test_watcher_tracks_each_provider_on_its_own(imds: FakeMetadata) -> None:
    seen = Recorder()
    watcher = SpotWatcher([imds.source(p) for p in ("aws", "gcp", "azure")], seen, 60)
    imds.set_notice("gcp", True)
    assert watcher.poll_once() == ["gcp"]
    imds.set_notice("aws", True)
    imds.set_notice("azure", True)
    assert watcher.poll_once() == ["aws", "azure"]
    assert watcher.poll_once() == []
    assert [p for p, _ in seen.calls] == ["gcp", "aws", "azure"]


def test_an_azure_freeze_never_fires_the_watcher(imds: FakeMetadata) -> None:
    seen = Recorder()
    watcher = SpotWatcher([imds.source("azure")], seen, 60)
    imds.state.azure_events = [dict(AZURE_FREEZE)]
    assert watcher.poll_once() == []
    assert watcher.poll_once() == []
    assert seen.calls == []


def test_a_failing_on_notice_does_not_raise_out_of_poll_once(imds: FakeMetadata) -> None:
    def boom(provider: str, detail: str) -> None:
        raise RuntimeError(f"drain failed for {provider}: {detail}")

    watcher = SpotWatcher([imds.source("gcp")], boom, 60)
    imds.set_notice("gcp", True)
    assert watcher.poll_once() == ["gcp"]
    assert watcher.poll_once() == []


# ---- unreachable sources ------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_an_unreachable_source_is_ignored_without_raising(
    imds: FakeMetadata, provider: str
) -> None:
    port = closed_port()
    path = urlsplit(imds.source(provider).url)
    dead = SpotSource(provider, f"http://127.0.0.1:{port}{path.path}"
                                + (f"?{path.query}" if path.query else ""))
    with pytest.raises(OSError):
        check(dead)  # documented: OSError when unreachable

    seen = Recorder()
    watcher = SpotWatcher([dead, imds.source(provider)], seen, 60)
    assert watcher.poll_once() == []
    imds.set_notice(provider, True)
    # the dead source is skipped; the live one next to it still fires
    assert watcher.poll_once() == [provider]
    assert [p for p, _ in seen.calls] == [provider]


# ---- sources_from -------------------------------------------------------------------------


def test_sources_from_uses_the_given_urls_or_the_defaults() -> None:
    got = sources_from(["aws", "gcp", "azure"], {"aws": "http://127.0.0.1:1/x", "gcp": ""})
    assert got == [
        SpotSource("aws", "http://127.0.0.1:1/x"),
        SpotSource("gcp", DEFAULT_URLS["gcp"]),
        SpotSource("azure", DEFAULT_URLS["azure"]),
    ]
    assert sources_from([], {}) == []


@pytest.mark.parametrize("provider", ["oracle", "AWS", "", "aws "])
def test_sources_from_rejects_an_unknown_provider(provider: str) -> None:
    with pytest.raises(ValueError, match="unknown spot provider"):
        sources_from(["aws", provider], {})


def test_check_rejects_an_unknown_provider() -> None:
    with pytest.raises(ValueError, match="unknown spot provider"):
        check(SpotSource("oracle", "http://127.0.0.1:1/"))


# ---- proxies from the environment -------------------------------------------------------


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_a_dead_http_proxy_in_the_environment_does_not_affect_checks(
    imds: FakeMetadata, provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead_proxy = f"http://127.0.0.1:{closed_port()}"
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, dead_proxy)
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)

    assert check(imds.source(provider)) is None
    imds.set_notice(provider, True)
    assert check(imds.source(provider)) is not None
    seen = Recorder()
    assert SpotWatcher([imds.source(provider)], seen, 60).poll_once() == [provider]



# ---- malformed answers --------------------------------------------------------------------
# "nothing here ever raises into the daemon" (the module's docstring): an answer that is not
# what the cloud serves (another service on the address, a broken proxy) is no notice.


class NotHttp:
    """A TCP server on 127.0.0.1 that answers every connection with a non-HTTP banner."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    conn.recv(65536)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()


MALFORMED = {
    "aws-json-list": ("aws", AWS_PATH, b"[1, 2]"),
    "aws-json-string": ("aws", AWS_PATH, b'"terminate"'),
    "azure-events-null": ("azure", AZURE_PATH, b'{"DocumentIncarnation": 1, "Events": null}'),
    "azure-event-not-an-object": ("azure", AZURE_PATH, b'{"Events": ["Preempt"]}'),
    "azure-doc-a-list": ("azure", AZURE_PATH, b"[]"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_document_does_not_raise_out_of_poll_once(
    imds: FakeMetadata, case: str
) -> None:
    provider, path, body = MALFORMED[case]
    imds.state.override[path] = (200, body)
    seen = Recorder()
    watcher = SpotWatcher([imds.source(provider)], seen, 60)
    watcher.poll_once()  # must not raise; whether it counts as a notice is not asked here


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_a_non_http_service_on_the_address_does_not_raise_out_of_poll_once(
    imds: FakeMetadata, provider: str
) -> None:
    other = NotHttp()
    try:
        path = urlsplit(imds.source(provider).url)
        src = SpotSource(provider, f"http://127.0.0.1:{other.port}{path.path}"
                                   + (f"?{path.query}" if path.query else ""))
        assert SpotWatcher([src], Recorder(), 60).poll_once() == []
    finally:
        other.close()


def test_the_watcher_thread_goes_on_after_a_malformed_answer(imds: FakeMetadata) -> None:
    seen = Recorder()
    fired = threading.Event()

    def on_notice(provider: str, detail: str) -> None:
        seen(provider, detail)
        fired.set()

    imds.state.override[AZURE_PATH] = (200, b'{"Events": ["Preempt"]}')
    watcher = SpotWatcher([imds.source("azure")], on_notice, interval_s=0.05)
    watcher.start()
    try:
        wait = threading.Event()
        wait.wait(0.5)  # several polls of the malformed answer
        imds.state.override.clear()
        imds.set_notice("azure", True)
        assert fired.wait(5), (
            "the watcher thread stopped polling after a malformed answer: a real notice that "
            "followed was never seen"
        )
    finally:
        watcher.stop()
    assert [p for p, _ in seen.calls] == ["azure"]
