"""`tide demo`: an elastic Paddle job scaled up and down by synthetic GPU load, end to end.

1. `tide up`'s control plane starts under the state dir (coordinator, scaler
   with the local actuator), with a synthetic GPU node the demo drives.
2. The example job (tide/trainer/examples/train_mlp.py; ``--workload sharded``:
   train_sharded.py, a fleet script with AdamW's state sharded over the ranks)
   is registered with the scaler at 2 replicas; the scaler starts it (a JOB_STARTED decision 0 → 2:
   the local actuator starts the launchers, the coordinator forms generation 1).
3. HIGH: every GPU of the job reports ~95 %; after the sustain window the
   scaler decides 2 → 4, newcomers start and warm up, the job checkpoints at
   one step and re-forms with 4 workers.
4. LOW: ~15 %; after the cooldown and the sustain window the scaler decides
   4 → 2: a checkpoint, the two highest pods drain, the rest re-form.
5. The control plane stops; the summary lists each decision with its states
   and pause, the lost steps, and audits the trainer's sample log: every
   sample consumed exactly once. A PNG chart shows utilization, workers and
   the decisions.

The policy windows are short (sustain 10 s, bucket 2 s, cooldown 10 s; the goodput
guard off, since CPU workers on a shared machine rarely scale), so a
default run takes 1-2 minutes; ``--cycles`` and ``--hold-s`` make it longer.
Each run is a new job (``demo/run-N``) in the same store, so ``tide history
demo/run-N --db sqlite:///DIR/tide.db`` reads what it did.

One module per thing that changes together:

- :mod:`.settings`: the knobs `tide demo`'s flags set, validated;
- :mod:`.spec`: the set-up: the control plane's flags, the example job, the policy;
- :mod:`.scenario`: the phases, their order, and when a phase reached its goal;
- :mod:`.poll`: what the demo reads from the scaler and the coordinator, as Snapshots;
- :mod:`.report`: the outcome, the summary lines and the chart;
- :mod:`.driver`: :class:`Demo`, which runs it all.
"""

from tide.services.local.demo.driver import Demo
from tide.services.local.demo.report import Outcome, summary_lines
from tide.services.local.demo.scenario import (
    DEMO_LIFECYCLE,
    Phase,
    goal_reached,
    next_job_id,
    next_phase,
)
from tide.services.local.demo.settings import RPC_TIMEOUT_S, WORKLOADS, DemoSettings
from tide.services.local.demo.spec import ROOT

__all__ = [
    "DEMO_LIFECYCLE",
    "ROOT",
    "RPC_TIMEOUT_S",
    "WORKLOADS",
    "Demo",
    "DemoSettings",
    "Outcome",
    "Phase",
    "goal_reached",
    "next_job_id",
    "next_phase",
    "summary_lines",
]
