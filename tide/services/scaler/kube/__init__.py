"""The scaler's side of Kubernetes: PaddleJobs read (paddlejob, pure), the client and
its watch-backed caches (client, capacity), discovery of opted-in jobs and the
Events posted on them (discovery, events). The actuator itself is
tide/services/scaler/actuators/kubernetes.py."""
