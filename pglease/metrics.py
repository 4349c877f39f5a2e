"""Prometheus metrics for one process: ``pip install 'pglease[metrics]'``.

``pglease.metrics.serve(9464)`` registers pglease's collectors and serves them
at ``http://127.0.0.1:9464/metrics``; ``enable()`` only registers them, for a
process that already exposes prometheus_client's registry itself. Until then
pglease reports into no-op hooks (`pglease._instrument`) and never imports
prometheus_client.

Collectors go into prometheus_client's default registry unless `enable` is
given another, so an application's own metrics and pglease's share one
endpoint. Counters and histograms count what this process did since it
started; labels are closed sets of words (never a resource key or an owner).
README "Metrics" lists every name and label and some PromQL queries.
"""

from __future__ import annotations

import socket
import threading
import time
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from . import _instrument
from .errors import MetricsError, MetricsUnavailableError, ValidationError
from .types import Event

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client import make_wsgi_app as _make_wsgi_app
except ImportError as _exc:  # the extra is not installed
    raise MetricsUnavailableError(
        "pglease.metrics needs prometheus-client, which is not installed:"
        " pip install 'pglease[metrics]'"
    ) from _exc

__all__ = ["MetricsServer", "enable", "serve"]

#: Label values of each labelled metric (created up front, so every series
#: exists from the first scrape and rate() sees its first increase).
CLAIM_OUTCOMES = ("claimed", "held", "busy", "error")
RENEWAL_SOURCES = ("store", "keeper")
RENEWAL_OUTCOMES = ("renewed", "busy", "lost", "error")
RELEASE_OUTCOMES = ("released", "lost", "error")
LOSS_CAUSES = (
    "trust_window",
    "not_current",
    "expired",
    "unknown_resource",
    "superseded",
    "abandoned",
)
ACQUIRE_OUTCOMES = ("acquired", "timeout", "cancelled", "error")
WATCH_MODES = ("listen", "poll")

_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LATE = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_WAIT = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_LAG = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _PrometheusRecorder(_instrument.Recorder):
    """Turns the hooks into prometheus_client updates (thread-safe, as they are)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        claims = Counter("pglease_claims", "Claim attempts by outcome", ["outcome"], registry=r)
        self._claims = {o: claims.labels(o) for o in CLAIM_OUTCOMES}
        renewals = Counter(
            "pglease_renewals",
            "Lease renewals (store API calls and keeper heartbeats, per lease) by outcome",
            ["source", "outcome"],
            registry=r,
        )
        self._renewals = {
            (s, o): renewals.labels(s, o) for s in RENEWAL_SOURCES for o in RENEWAL_OUTCOMES
        }
        releases = Counter(
            "pglease_releases",
            "Releases through the store API by outcome",
            ["outcome"],
            registry=r,
        )
        self._releases = {o: releases.labels(o) for o in RELEASE_OUTCOMES}
        self._beat = Histogram(
            "pglease_heartbeat_duration_seconds",
            "Round trip of a keeper heartbeat (one beat renews every due lease)",
            buckets=_FAST,
            registry=r,
        )
        self._beat_errors = Counter(
            "pglease_heartbeat_errors",
            "Keeper heartbeats that failed and were retried",
            registry=r,
        )
        self._late = Histogram(
            "pglease_heartbeat_lateness_seconds",
            "How long after its planned time a keeper heartbeat started",
            buckets=_LATE,
            registry=r,
        )
        held = Gauge(
            "pglease_leases_held", "Leases this process's keepers are renewing", registry=r
        )
        held.set_function(_instrument.leases_held)
        lost = Counter("pglease_leases_lost", "Held leases lost, by cause", ["cause"], registry=r)
        self._lost = {c: lost.labels(c) for c in LOSS_CAUSES}
        acquire = Histogram(
            "pglease_acquire_wait_seconds",
            "Time a blocking acquire (or hold) spent until it won, timed out or failed",
            ["outcome"],
            buckets=_WAIT,
            registry=r,
        )
        self._acquire = {o: acquire.labels(o) for o in ACQUIRE_OUTCOMES}
        reads = Counter(
            "pglease_watch_reads", "Event-log reads by the watch hubs", ["mode"], registry=r
        )
        self._reads = {m: reads.labels(m) for m in WATCH_MODES}
        events = Counter("pglease_watch_events", "Events the watch hubs read", ["mode"], registry=r)
        self._events = {m: events.labels(m) for m in WATCH_MODES}
        reconnects = Counter(
            "pglease_watch_reconnects",
            "Watch hub connections opened again after one was lost",
            ["mode"],
            registry=r,
        )
        self._reconnects = {m: reconnects.labels(m) for m in WATCH_MODES}
        self._lag = Histogram(
            "pglease_watch_lag_seconds",
            "From an event's creation (database clock) to its read by the watch hub"
            " (this host's clock)",
            buckets=_LAG,
            registry=r,
        )
        self._reaper_passes = Counter(
            "pglease_reaper_passes", "Reaper passes over expired leases", registry=r
        )
        self._reaped = Counter(
            "pglease_reaped_leases", "lease.expired events the reaper wrote", registry=r
        )
        self._prunes = Counter("pglease_prunes", "Prune runs", registry=r)
        self._pruned_events = Counter(
            "pglease_pruned_events", "Events deleted by prune", registry=r
        )
        self._pruned_payloads = Counter(
            "pglease_pruned_payloads", "Unreferenced payloads deleted by prune", registry=r
        )

    def claim(self, outcome: str) -> None:
        self._claims[outcome].inc()

    def renewal(self, source: str, outcome: str) -> None:
        self._renewals[source, outcome].inc()

    def release(self, outcome: str) -> None:
        self._releases[outcome].inc()

    def heartbeat(self, seconds: float) -> None:
        self._beat.observe(seconds)

    def heartbeat_failed(self) -> None:
        self._beat_errors.inc()

    def heartbeat_lateness(self, seconds: float) -> None:
        self._late.observe(seconds)

    def lease_lost(self, cause: str) -> None:
        self._lost[cause].inc()

    def acquire_wait(self, seconds: float, outcome: str) -> None:
        self._acquire[outcome].observe(max(0.0, seconds))

    def hub_read(self, mode: str, events: list[Event]) -> None:
        self._reads[mode].inc()
        if events:
            self._events[mode].inc(len(events))
            now = time.time()
            for event in events:
                # Across two clocks: skew between this host and the server shows
                # up here (an ahead server reads as less lag, clamped at zero).
                self._lag.observe(max(0.0, now - event.created_at.timestamp()))

    def hub_reconnect(self, mode: str) -> None:
        self._reconnects[mode].inc()

    def reaped(self, leases: int) -> None:
        self._reaper_passes.inc()
        self._reaped.inc(leases)

    def pruned(self, events: int, payloads: int) -> None:
        self._prunes.inc()
        self._pruned_events.inc(events)
        self._pruned_payloads.inc(payloads)


_lock = threading.Lock()
_recorder: _PrometheusRecorder | None = None


def enable(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Register pglease's collectors (once per process) and start recording.

    `registry` defaults to prometheus_client's default `REGISTRY`. Calling it
    again is harmless and returns the same registry; asking for another
    registry after that raises `MetricsError` (a process has one set of
    pglease metrics).
    """
    global _recorder
    wanted = REGISTRY if registry is None else registry
    with _lock:
        if _recorder is None:
            _recorder = _PrometheusRecorder(wanted)
            _instrument.install(_recorder)
        elif registry is not None and registry is not _recorder.registry:
            raise MetricsError(
                "pglease metrics are already enabled on another registry; a process has one set"
            )
        return _recorder.registry


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per scrape, none kept: a slow scraper cannot block another."""

    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: scrapes every few seconds would flood it."""

    def log_message(self, format: str, *args: Any) -> None:
        return None


class MetricsServer:
    """A running metrics endpoint: `url`, `port` (the real one when 0 was asked),
    and `stop()` (also on leaving a ``with`` block)."""

    def __init__(self, server: _Server, addr: str) -> None:
        self._server = server
        self.addr = addr
        self.port: int = server.server_address[1]
        host = f"[{addr}]" if ":" in addr else addr
        self.url = f"http://{host}:{self.port}/metrics"
        self._thread = threading.Thread(
            target=server.serve_forever, name="pglease-metrics", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket (the metrics keep recording)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=10)
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValidationError(f"metrics port must be an int from 0 to 65535, got {port!r}")
    return port


def serve(
    port: int, addr: str = "127.0.0.1", *, registry: CollectorRegistry | None = None
) -> MetricsServer:
    """`enable` metrics and serve them over HTTP at ``http://ADDR:PORT/metrics``
    from a daemon thread; port 0 picks a free one (read `MetricsServer.port`).

    Loopback by default: pass ``addr="0.0.0.0"`` (or ``"::"``) for a scraper on
    another host. A port in use or an address not of this host raises
    `MetricsError`.
    """
    port = _check_port(port)
    if not isinstance(addr, str) or not addr:
        raise ValidationError(f"metrics address must be a host address, got {addr!r}")
    app = _make_wsgi_app(enable(registry))
    server_class = _Server6 if ":" in addr else _Server
    try:
        server = make_server(addr, port, app, server_class, _QuietHandler)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise MetricsError(f"cannot serve metrics on {addr}:{port}: {reason}") from exc
    return MetricsServer(server, addr)
