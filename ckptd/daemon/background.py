"""The daemon's background work, started after it serves and stopped before it exits:
periodic GC, periodic policies, the spot-notice watcher, the Prometheus endpoint and the
systemd watchdog ping. Each loop logs its failures and goes on; none of them can stop the
daemon."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ckptd.adapters.cloud.spot import SpotWatcher, sources_from
from ckptd.core.service import RETENTION_GC_MIN_S
from ckptd.daemon import sdnotify
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.metrics import Metrics, MetricsServer
from ckptd.daemon.wiring import Wired
from ckptd.domain.model import ROOT

log = logging.getLogger("ckptd")


class Background:
    def __init__(self, config: DaemonConfig, wired: Wired) -> None:
        self._config = config
        self._wired = wired
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._spot: SpotWatcher | None = None
        self.metrics_server: MetricsServer | None = None

    def start_metrics(self) -> None:
        """The Prometheus endpoint, if configured. Raises OSError/ValueError when it cannot
        listen (the daemon then refuses to start: a configured endpoint is expected)."""
        if not self._config.metrics_listen:
            return
        store = self._wired.store

        def store_size() -> tuple[int, int]:
            records = store.list()
            return len(records), sum(r.bytes_new for r in records)

        metrics = Metrics(store_size)
        self._wired.service.events.add_listener(metrics.on_event)
        self.metrics_server = metrics.serve(self._config.metrics_listen)
        log.info("metrics on %s, port %d", self._config.metrics_listen, self.metrics_server.port)

    def start(self) -> None:
        cfg, wired = self._config, self._wired
        if cfg.gc_interval_s > 0:
            self._loop("gc", cfg.gc_interval_s, lambda: wired.service.gc(ROOT))
            # what a policy's --keep deletes is collected within about a minute, not at the
            # next gc_interval_s (issue 34, 8: --every 10s grew the store 13 MB/s)
            after = min(RETENTION_GC_MIN_S, cfg.gc_interval_s)
            self._loop("gc-after-retention", min(5.0, after),
                       lambda: wired.service.collect_after_retention(after))
        if cfg.policy_tick_s > 0:
            self._loop("policies", cfg.policy_tick_s, wired.policies.tick)
        # transfers whose sender went away: their staging is dropped without waiting for the
        # next migration to come in
        self._loop("peer-sessions", 30.0, wired.receiver.expire)
        interval = sdnotify.watchdog_interval_s()
        if interval:
            self._loop("watchdog", interval, lambda: sdnotify.notify("WATCHDOG=1"))
        providers = [p.strip() for p in cfg.spot_providers.split(",") if p.strip()]
        if providers:
            urls = {"aws": cfg.spot_aws_url, "gcp": cfg.spot_gcp_url, "azure": cfg.spot_azure_url}
            self._spot = SpotWatcher(sources_from(providers, urls),
                                     wired.policies.spot_notice, cfg.spot_poll_s)
            self._spot.start()
            log.info("watching spot notices of %s every %gs", ", ".join(providers),
                     cfg.spot_poll_s)

    def _loop(self, name: str, every_s: float, body: Callable[[], object]) -> None:
        def run() -> None:
            while not self._stop.wait(every_s):
                try:
                    body()
                except Exception:
                    log.exception("%s loop failed", name)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        # held group members are undone now, not when their hold times out after we are gone
        self._wired.groups.abort_all()
        if self._spot is not None:
            self._spot.stop()
        if self.metrics_server is not None:
            self.metrics_server.stop()
