-- Why did job X scale at 14.05? Step 1: the decisions of the job created in [since, until).
-- SQLite version (times are stored as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff').
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
  AND d.created_at >= strftime('%Y-%m-%d %H:%M:%f', :since) || '000'
  AND d.created_at < strftime('%Y-%m-%d %H:%M:%f', :until) || '000'
ORDER BY d.created_at DESC, d.id DESC;
