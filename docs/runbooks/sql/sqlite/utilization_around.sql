-- Why did job X scale? Step 4: what the job's GPUs did, minute by minute, around the decision.
-- SQLite version (times are stored as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff').
-- Parameters: decision_id, context_minutes (on each side).
SELECT r.minute,
       r.mean_pct,
       r.min_pct,
       r.max_pct,
       r.samples,
       r.replicas,
       r.minute = strftime('%Y-%m-%d %H:%M:00.000000', d.created_at) AS decision_minute
FROM utilization_rollups AS r
JOIN decisions AS d ON d.job_id = r.job_id
WHERE d.id = :decision_id
  AND r.minute >= strftime('%Y-%m-%d %H:%M:00.000000', d.created_at,
                           '-' || :context_minutes || ' minutes')
  AND r.minute <= strftime('%Y-%m-%d %H:%M:00.000000', d.created_at,
                           '+' || :context_minutes || ' minutes')
ORDER BY r.minute;
