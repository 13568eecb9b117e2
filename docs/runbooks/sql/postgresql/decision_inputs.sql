-- Why did job X scale? Step 2: what the policy saw, and the thresholds it applied.
-- The inputs are stored with the decision (DecisionInputs as JSON, proto field names).
-- Parameters: decision_id.
SELECT d.id,
       d.job_id,
       d.reason,
       d.trigger,
       d.message,
       d.from_replicas,
       d.to_replicas,
       CAST(d.inputs -> 'window' ->> 'mean_pct' AS double precision) AS window_mean_pct,
       d.inputs -> 'window' -> 'bucket_means_pct' AS bucket_means_pct,
       CAST(d.inputs -> 'window' ->> 'bucket_s' AS double precision) AS bucket_s,
       CAST(d.inputs -> 'window' ->> 'coverage' AS double precision) AS coverage,
       CAST(d.inputs -> 'policy' ->> 'scale_up_utilization_pct' AS double precision) AS scale_up_pct,
       CAST(d.inputs -> 'policy' ->> 'scale_down_utilization_pct' AS double precision)
           AS scale_down_pct,
       CAST(d.inputs -> 'policy' ->> 'sustain_s' AS double precision) AS sustain_s,
       CAST(d.inputs -> 'policy' ->> 'cooldown_s' AS double precision) AS cooldown_s,
       CAST(d.inputs ->> 'raw_target_replicas' AS integer) AS raw_target_replicas,
       CAST(d.inputs ->> 'free_gpus' AS integer) AS free_gpus
FROM decisions AS d
WHERE d.id = :decision_id;
