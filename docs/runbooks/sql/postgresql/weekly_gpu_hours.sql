-- What did scaling save this week? Per job, from the per-minute rollups: GPU-hours held,
-- what holding max_replicas the whole time would have cost, the difference, and how many
-- of the held GPU-hours were idle (100 % minus utilization). Minutes without telemetry
-- are not counted. max_replicas is today's bound. Rollups are kept rollup_retention_days
-- (30 unless changed): an older week answers nothing.
-- Parameters: since, until.
SELECT r.job_id,
       count(*) AS minutes,
       sum(r.replicas * j.gpus_per_replica) / 60.0 AS gpu_hours_held,
       sum(j.max_replicas * j.gpus_per_replica) / 60.0 AS gpu_hours_at_max,
       sum((j.max_replicas - r.replicas) * j.gpus_per_replica) / 60.0 AS gpu_hours_saved_vs_max,
       sum(r.replicas * j.gpus_per_replica * (100.0 - r.mean_pct) / 100.0) / 60.0
           AS gpu_hours_idle,
       sum(r.replicas * r.mean_pct) / NULLIF(sum(r.replicas), 0) AS mean_utilization_pct
FROM utilization_rollups AS r
JOIN jobs AS j ON j.job_id = r.job_id
WHERE r.minute >= CAST(:since AS timestamptz)
  AND r.minute < CAST(:until AS timestamptz)
GROUP BY r.job_id
ORDER BY r.job_id;
