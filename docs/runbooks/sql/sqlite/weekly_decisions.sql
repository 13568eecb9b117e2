-- What did scaling cost this week? Per job: decisions by outcome, the training pause they
-- caused (seconds, and GPU-seconds: the pause times the GPUs of the new size, which sat
-- idle meanwhile), and steps lost. A job's start (reason JOB_STARTED, 0 -> N) is counted
-- apart: its "pause" is the job's start-up, not a cost of scaling.
-- SQLite version (times are stored as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff').
-- Final decisions are kept decision_retention_days (180 unless changed).
-- Parameters: since, until (e.g. Monday 00.00 UTC and the next Monday).
SELECT d.job_id,
       count(*) AS decisions,
       count(*) FILTER (WHERE d.state = 'COMPLETED') AS completed,
       count(*) FILTER (WHERE d.state = 'ABORTED') AS aborted,
       count(*) FILTER (WHERE d.state = 'FAILED') AS failed,
       count(*) FILTER (WHERE d.reason = 'JOB_STARTED') AS starts,
       count(*) FILTER (WHERE d.state = 'COMPLETED' AND d.to_replicas > d.from_replicas
                          AND d.reason <> 'JOB_STARTED') AS grows,
       count(*) FILTER (WHERE d.state = 'COMPLETED' AND d.to_replicas < d.from_replicas)
           AS shrinks,
       count(*) FILTER (WHERE d.trigger = 'MANUAL' AND d.reason <> 'JOB_STARTED') AS manual,
       COALESCE(sum(d.pause_s) FILTER (WHERE d.reason <> 'JOB_STARTED'), 0) AS pause_s_total,
       COALESCE(max(d.pause_s) FILTER (WHERE d.reason <> 'JOB_STARTED'), 0) AS pause_s_max,
       COALESCE(sum(d.pause_s * d.to_replicas * j.gpus_per_replica)
                FILTER (WHERE d.reason <> 'JOB_STARTED'), 0) AS pause_gpu_s,
       COALESCE(sum(d.lost_steps), 0) AS lost_steps
FROM decisions AS d
JOIN jobs AS j ON j.job_id = d.job_id
WHERE d.created_at >= strftime('%Y-%m-%d %H:%M:%f', :since) || '000'
  AND d.created_at < strftime('%Y-%m-%d %H:%M:%f', :until) || '000'
GROUP BY d.job_id
ORDER BY d.job_id;
