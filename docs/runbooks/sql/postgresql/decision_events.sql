-- Why did job X scale? Step 3: every state the decision went through, with the time
-- since it was created. A final state is COMPLETED, ABORTED or FAILED.
-- Parameters: decision_id.
SELECT e.state,
       e.at,
       EXTRACT(EPOCH FROM e.at - d.created_at) AS seconds_after_created,
       e.detail
FROM decision_events AS e
JOIN decisions AS d ON d.id = e.decision_id
WHERE e.decision_id = :decision_id
ORDER BY e.at, e.id;
