"""``dramatiq-gp exporter``: the deployment's queues, outbox, scheduler and workers as Prometheus metrics.

The worker processes export what each of them does (:mod:`dramatiq_gp.prometheus`);
what the deployment holds (messages waiting in each queue, the outbox's backlog,
whether a scheduler leads) is the same whoever reads it, so one exporter reads it
for all, and a sum over its series counts each message once. KEDA, an HPA or an
alert rule read these names; the names differ from the workers' own on purpose.
"""

from __future__ import annotations

#: Every metric the exporter serves: name → (Prometheus type, help). Alert rules and dashboards use these names.
METRICS: dict[str, tuple[str, str]] = {
    "dramatiq_gp_queue_messages": (
        "gauge",
        "Messages in a queue, by state: ready, delayed, in_flight, dead.",
    ),
    "dramatiq_gp_queue_oldest_ready_age_seconds": (
        "gauge",
        "Age of the oldest ready message in a queue, since it became due (0 when none is ready).",
    ),
    "dramatiq_gp_outbox_pending_events": ("gauge", "Outbox rows not yet relayed."),
    "dramatiq_gp_outbox_lag_seconds": ("gauge", "Age of the oldest pending outbox row (0 when none)."),
    "dramatiq_gp_outbox_set_aside_events": ("gauge", "Outbox rows set aside after failing to relay."),
    "dramatiq_gp_scheduler_leader_present": ("gauge", "1 when a scheduler holds the leader lease, else 0."),
    "dramatiq_gp_scheduler_leaderless_seconds": (
        "gauge",
        "How long no scheduler has held the lease, as far as this exporter has seen (0 while one does).",
    ),
    "dramatiq_gp_scheduler_lease_ttl_seconds": ("gauge", "The scheduler's lease time to live (SCHEDULER_LEASE_TTL)."),
    "dramatiq_gp_schedule_last_fire_timestamp_seconds": ("gauge", "When a schedule entry last fired (Unix time)."),
    "dramatiq_gp_schedule_paused": ("gauge", "1 when a schedule entry is paused, else 0."),
    "dramatiq_gp_worker_alive": ("gauge", "1 when a worker process reports itself alive, else 0."),
    "dramatiq_gp_worker_ready": ("gauge", "1 when a worker process reports itself ready, else 0."),
    "dramatiq_gp_exporter_source_up": (
        "gauge",
        "1 when the exporter could read a source (redis, rabbitmq, postgresql), else 0.",
    ),
}
