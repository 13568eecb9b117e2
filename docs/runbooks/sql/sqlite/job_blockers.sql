-- Why didn't job X scale? What would stop the policy right now: a pause, a decision
-- still running, the cooldown after the last resize, the replica bounds.
-- SQLite version (times are stored as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff').
-- Parameters: job_id, default_cooldown_s (the scaler's configured cooldown_s, used when
-- the job has no override; 300 unless changed).
SELECT j.job_id,
       j.current_replicas,
       j.min_replicas,
       j.max_replicas,
       j.autoscaling_paused,
       j.pause_reason,
       j.paused_at,
       j.last_resize_ended_at,
       strftime('%Y-%m-%d %H:%M:%f', j.last_resize_ended_at,
                '+' || COALESCE(CAST(j.policy_overrides ->> 'cooldown_s' AS REAL),
                                CAST(:default_cooldown_s AS REAL)) || ' seconds') AS cooldown_ends_at,
       (SELECT d.id
          FROM decisions AS d
         WHERE d.job_id = j.job_id
           AND d.state IN ('PENDING', 'PREPARING', 'ACTUATING')
         ORDER BY d.created_at DESC, d.id DESC
         LIMIT 1) AS active_decision_id,
       j.current_replicas >= j.max_replicas AS at_max_replicas,
       j.current_replicas <= j.min_replicas AS at_min_replicas
FROM jobs AS j
WHERE j.job_id = :job_id;
