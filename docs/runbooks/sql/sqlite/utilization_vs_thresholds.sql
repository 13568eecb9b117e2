-- Why didn't job X scale? Was the load really sustained? Per minute of [since, until):
-- a scale-up needs every bucket of the sustain window above the threshold, so one
-- minute whose mean is not above it is enough to reset the window. min_pct/max_pct
-- are single samples: a minute can clear on its mean and still dip.
-- SQLite version (times are stored as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff').
-- Parameters: job_id, since, until, scale_up_pct, scale_down_pct.
SELECT r.minute,
       r.mean_pct,
       r.min_pct,
       r.max_pct,
       r.samples,
       r.replicas,
       r.mean_pct > CAST(:scale_up_pct AS REAL) AS mean_above_scale_up,
       r.mean_pct < CAST(:scale_down_pct AS REAL) AS mean_below_scale_down
FROM utilization_rollups AS r
WHERE r.job_id = :job_id
  AND r.minute >= strftime('%Y-%m-%d %H:%M:%f', :since) || '000'
  AND r.minute < strftime('%Y-%m-%d %H:%M:%f', :until) || '000'
ORDER BY r.minute;
