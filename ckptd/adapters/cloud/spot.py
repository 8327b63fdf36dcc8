"""Spot / preemption notices from the cloud's instance metadata service.

- AWS: ``GET /latest/meta-data/spot/instance-action`` (IMDSv2 token first, v1 if refused):
  404 while nothing is planned; 200 with ``{"action": "terminate|stop|hibernate", "time":
  ...}`` about two minutes before the reclaim.
- GCP: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``:
  ``FALSE``, then ``TRUE`` once the VM is being preempted (about 30 s of notice).
- Azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``:
  ``{"Events": [{"EventType": "Preempt" | "Terminate" | ..., "NotBefore": ...}]}``.

``SpotWatcher`` polls the configured ones and calls ``on_notice(provider, detail)`` once per
notice (again only after the notice has gone away). A provider that cannot be reached is
ignored (the node is not on that cloud); nothing here ever raises into the daemon.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_URLS: Mapping[str, str] = {
    "aws": "http://169.254.169.254/latest/meta-data/spot/instance-action",
    "gcp": "http://metadata.google.internal/computeMetadata/v1/instance/preempted",
    "azure": "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01",
}
TIMEOUT_S = 2.0
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Metadata services are link-local: never through an HTTP proxy from the environment."""


@dataclass(frozen=True)
class SpotSource:
    provider: str
    url: str


def _get(url: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with _OPENER.open(request, timeout=TIMEOUT_S) as response:
            return int(response.status), response.read(1 << 20)
    except urllib.error.HTTPError as exc:
        return int(exc.code), b""


def _aws_token(url: str) -> str:
    base = url.split("/latest/", 1)[0]
    request = urllib.request.Request(
        f"{base}/latest/api/token", method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"},
    )
    try:
        with _OPENER.open(request, timeout=TIMEOUT_S) as response:
            return str(response.read(4096).decode())
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return ""


def check(source: SpotSource) -> str | None:
    """The notice ``source`` gives now, in words, or None. Raises OSError when unreachable."""
    if source.provider == "aws":
        token = _aws_token(source.url)
        status, body = _get(source.url, {"X-aws-ec2-metadata-token": token} if token else {})
        if status != 200:
            return None
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            return f"instance-action: {body[:200].decode(errors='replace')}"
        return f"{doc.get('action', 'action')} at {doc.get('time', '?')}"
    if source.provider == "gcp":
        status, body = _get(source.url, {"Metadata-Flavor": "Google"})
        if status == 200 and body.strip().upper() == b"TRUE":
            return "preempted"
        return None
    if source.provider == "azure":
        status, body = _get(source.url, {"Metadata": "true"})
        if status != 200:
            return None
        try:
            doc = json.loads(body)
        except ValueError:
            return None
        events = doc.get("Events") if isinstance(doc, dict) else None
        if not isinstance(events, list):
            return None
        hits = [e for e in events
                if isinstance(e, dict) and e.get("EventType") in ("Preempt", "Terminate")]
        if not hits:
            return None
        first = hits[0]
        return f"{first.get('EventType')} not before {first.get('NotBefore', '?')}"
    raise ValueError(f"unknown spot provider {source.provider!r}: use aws, gcp or azure")


class SpotWatcher:
    def __init__(
        self,
        sources: list[SpotSource],
        on_notice: Callable[[str, str], object],
        interval_s: float = 5.0,
    ) -> None:
        self._sources = sources
        self._on_notice = on_notice
        self._interval = interval_s
        self._stop = threading.Event()
        self._active: set[str] = set()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> list[str]:
        """Check every source once; returns the providers that raised a new notice."""
        fired = []
        for source in self._sources:
            try:
                detail = check(source)
            except (OSError, ValueError, http.client.HTTPException) as exc:
                log.debug("spot source %s unreachable: %s", source.provider, exc)
                continue
            except Exception:  # an odd answer must never stop the watching
                log.exception("spot source %s gave an unexpected answer", source.provider)
                continue
            if detail is None:
                self._active.discard(source.provider)
                continue
            if source.provider in self._active:
                continue
            self._active.add(source.provider)
            fired.append(source.provider)
            try:
                self._on_notice(source.provider, detail)
            except Exception:
                log.exception("handling the spot notice from %s failed", source.provider)
        return fired

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spot-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.poll_once()
            except Exception:
                log.exception("spot watcher: poll failed; going on")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval + TIMEOUT_S * 3)


def sources_from(providers: list[str], urls: Mapping[str, str]) -> list[SpotSource]:
    """Sources for ``providers`` (aws, gcp, azure), each at ``urls[p]`` or its default."""
    out = []
    for p in providers:
        if p not in DEFAULT_URLS:
            raise ValueError(f"unknown spot provider {p!r}: use aws, gcp or azure")
        out.append(SpotSource(p, urls.get(p) or DEFAULT_URLS[p]))
    return out
