"""Prometheus metrics, one registry per app (so several apps in one process, as in tests, do not collide)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from server.db.models import FineTuningJob, JobStatus


class JobStateCollector(Collector):
    """Job counts by state, read from the database at scrape time (queue depth is the `queued` count)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("zaya_fine_tuning_jobs", "Fine-tuning jobs by state", labels=["status"])
        with self.sessions() as session:
            rows = session.execute(select(FineTuningJob.status, func.count()).group_by(FineTuningJob.status))
            counts = dict(rows.all())
        for status in JobStatus:
            family.add_metric([status.value], counts.get(status.value, 0))
        yield family


class Metrics:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "zaya_http_requests", "HTTP requests", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "zaya_http_request_duration_seconds", "HTTP request latency", ["method", "route"], registry=self.registry
        )
        self.registry.register(JobStateCollector(sessions))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)
