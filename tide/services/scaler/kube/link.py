"""The scaler tied to a cluster: discovery of opted-in PaddleJobs and the Events
of every decision, around the Kubernetes actuator (``--actuator kubernetes:...``).

:meth:`KubeLink.attach` is handed the scaler's core by tide/services/scaler/app.py
and returns the background task that runs discovery; the actuator's caches,
the Event recorder and the watches end with it.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from tide.services.scaler.actuators.kubernetes import KubernetesActuator
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.kube.discovery import Discovery
from tide.services.scaler.kube.events import EventRecorder, decision_event, failure_event
from tide.services.scaler.kube.trust import TrustBundle
from tide.services.scaler.store import DecisionRecord

Background = Callable[[], Coroutine[Any, Any, None]]


class KubeLink:
    def __init__(
        self, actuator: KubernetesActuator, *, trust_configmap: str = "", ca_file: str = ""
    ) -> None:
        self.actuator = actuator
        # The ConfigMap the CA is copied into in each training namespace ("": none).
        self.trust_configmap = trust_configmap
        self.ca_file = ca_file
        self.recorder: EventRecorder | None = None
        self.discovery: Discovery | None = None

    def attach(self, core: ScalerCore) -> list[Background]:
        actuator = self.actuator
        recorder = self.recorder = EventRecorder(actuator.api)
        discovery = self.discovery = Discovery(
            actuator.api,
            core,
            recorder,
            actuator=actuator,
            namespaces=actuator.settings.namespaces,
            watch_timeout_s=actuator.settings.watch_timeout_s,
            trust=(
                TrustBundle(actuator.api, self.trust_configmap, self.ca_file)
                if self.trust_configmap
                else None
            ),
        )

        def on_decision(d: DecisionRecord, detail: str) -> None:
            discovery.event(d.job_id, decision_event(d, detail))

        def on_failure(job_id: str, why: str) -> None:
            discovery.event(job_id, failure_event(why))

        core.feed.observers.append(on_decision)
        core.feed.failure_observers.append(on_failure)

        async def run() -> None:
            actuator.start()
            try:
                await discovery.run()
            finally:
                recorder.close()
                actuator.stop()

        return [run]
