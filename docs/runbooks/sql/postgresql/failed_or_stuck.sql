-- Why didn't job X scale? Decisions that were tried and did not complete since a time:
-- aborted, failed, or not final yet, with the last thing that happened to each.
-- Parameters: since.
SELECT d.id,
       d.job_id,
       d.state,
       d.from_replicas,
       d.to_replicas,
       d.created_at,
       d.ended_at,
       d.error,
       (SELECT e.detail
          FROM decision_events AS e
         WHERE e.decision_id = d.id
         ORDER BY e.at DESC, e.id DESC
         LIMIT 1) AS last_event
FROM decisions AS d
WHERE d.state IN ('ABORTED', 'FAILED', 'PENDING', 'PREPARING', 'ACTUATING')
  AND d.created_at >= CAST(:since AS timestamptz)
ORDER BY d.created_at DESC, d.id DESC;
