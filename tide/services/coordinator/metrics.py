"""The coordinator's Prometheus metrics, in a registry of its own unless given one.

Label values are snake_case; ``job_id`` is bounded by the number of jobs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.resizes = Counter(
            "tide_coordinator_resizes_total",
            "Resizes that reached a final phase, by phase (completed, aborted, failed).",
            ["phase"],
            registry=r,
        )
        self.pause_seconds = Histogram(
            "tide_coordinator_resize_pause_duration_seconds",
            "Training pause of completed resizes: last hold to last first step.",
            buckets=(0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60, 120),
            registry=r,
        )
        self.generations = Counter(
            "tide_coordinator_generations_total",
            "Generations opened, by cause (resize, recovery).",
            ["cause"],
            registry=r,
        )
        self.members_lost = Counter(
            "tide_coordinator_members_lost_total",
            "Members (or their workers) declared lost, by job.",
            ["job_id"],
            registry=r,
        )
        self.lost_steps = Counter(
            "tide_coordinator_lost_steps_total",
            "Training steps lost to unplanned losses (reached minus restored), by job.",
            ["job_id"],
            registry=r,
        )
        self.restarts = Counter(
            "tide_coordinator_restarts_total",
            "Generations re-formed after an unplanned loss (each with its backoff), by job.",
            ["job_id"],
            registry=r,
        )
        self.jobs_failed = Counter(
            "tide_coordinator_jobs_failed_total",
            "Jobs failed for good: their restart budget spent by a crash loop, by job.",
            ["job_id"],
            registry=r,
        )
        self.commit_seconds = Histogram(
            "tide_coordinator_commit_duration_seconds",
            "Time to commit one unit of coordinator state.",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.durable_lag_seconds = Gauge(
            "tide_coordinator_durable_checkpoint_lag_seconds",
            "The job's newest durable checkpoint: seconds from its snapshot to its commit in"
            " the durable store (rank 0 writes it in the background after the pause).",
            ["job_id"],
            registry=r,
        )
        self.durable_step = Gauge(
            "tide_coordinator_durable_checkpoint_step",
            "The step of the job's newest checkpoint in the durable store.",
            ["job_id"],
            registry=r,
        )
        self.durable_timestamp = Gauge(
            "tide_coordinator_durable_checkpoint_timestamp_seconds",
            "When the job's newest durable checkpoint committed (unix seconds).",
            ["job_id"],
            registry=r,
        )
        self.commit_failures = Counter(
            "tide_coordinator_commit_failures_total",
            "Units that could not be committed (the job is reloaded from the store).",
            registry=r,
        )

    def durable(self, job_id: str, step: int, lag_s: float, at: float) -> None:
        """The job's newest durable checkpoint, as rank 0's launcher reported it."""
        self.durable_step.labels(job_id).set(step)
        self.durable_lag_seconds.labels(job_id).set(lag_s)
        if at:
            self.durable_timestamp.labels(job_id).set(at)
