-- Why did job X scale at 14.05? Step 1: the decisions of the job created in [since, until).
-- Final decisions are kept decision_retention_days (180 unless changed).
-- Parameters: job_id, since, until (timestamps; UTC unless they carry a zone).
SELECT d.id,
       d.created_at,
       d.from_replicas,
       d.to_replicas,
       d.reason,
       d.trigger,
       d.state,
       d.pause_s,
       d.lost_steps,
       d.requested_by,
       d.message,
       d.error
FROM decisions AS d
WHERE d.job_id = :job_id
  AND d.created_at >= CAST(:since AS timestamptz)
  AND d.created_at < CAST(:until AS timestamptz)
ORDER BY d.created_at DESC, d.id DESC;
