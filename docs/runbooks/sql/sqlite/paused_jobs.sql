-- During an incident: which jobs have autoscaling frozen, since when, and why.
-- Read-only: pause and resume through the scaler (tide pause / tide resume), never with
-- an UPDATE, so the scaler's in-memory state and the fencing epoch stay right.
-- SQLite version (times are stored as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff').
SELECT j.job_id,
       j.pause_reason,
       j.paused_at,
       j.current_replicas
FROM jobs AS j
WHERE j.autoscaling_paused
ORDER BY j.paused_at, j.job_id;
