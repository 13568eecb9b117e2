-- Why didn't job X scale? Was the load really sustained? Per minute of [since, until):
-- a scale-up needs every bucket of the sustain window above the threshold, so one
-- minute whose mean is not above it is enough to reset the window. min_pct/max_pct
-- are single samples: a minute can clear on its mean and still dip.
-- Parameters: job_id, since, until, scale_up_pct, scale_down_pct.
SELECT r.minute,
       r.mean_pct,
       r.min_pct,
       r.max_pct,
       r.samples,
       r.replicas,
       r.mean_pct > CAST(:scale_up_pct AS double precision) AS mean_above_scale_up,
       r.mean_pct < CAST(:scale_down_pct AS double precision) AS mean_below_scale_down
FROM utilization_rollups AS r
WHERE r.job_id = :job_id
  AND r.minute >= CAST(:since AS timestamptz)
  AND r.minute < CAST(:until AS timestamptz)
ORDER BY r.minute;
