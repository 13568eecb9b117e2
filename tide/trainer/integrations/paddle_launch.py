"""``paddle.distributed.launch``'s command line, translated to ``tide.trainer.launch``'s.

A user swaps the module name and keeps the rest::

    python -m paddle.distributed.launch --nnodes 2:4 --nproc_per_node 1 --job_id gpt train.py --lr 3e-4
    python -m tide.trainer.launch            --nnodes 2:4 --nproc_per_node 1 --job_id gpt train.py --lr 3e-4

A command line is Paddle-style when it names a script before any ``--`` (Tide's own form
ends its flags with ``-- python train.py``). Tide's own flags (``--coordinator``, ...) may be
mixed in. Each Paddle argument Tide cannot honour is refused with one line saying why
(``REFUSED``): the launcher exits 2 before it registers, rather than run a job that is not
what the command asked for. No Paddle import here: the launcher must not pay for it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence

from tide.base.errors import ConfigError

# The Paddle arguments Tide honours, and what each becomes (docs/migrate.md prints this table).
ACCEPTED: dict[str, str] = {
    "--nnodes": "N or MIN:MAX: the job's min/max replicas (pods); see `--print-job`",
    "--nproc_per_node": "--workers-per-pod: workers in this pod",
    "--log_dir": "--state-dir: the workers' logs, one file per worker and generation",
    "--job_id": "--job: NAME becomes POD_NAMESPACE/NAME (default/NAME outside a pod)",
    "--master": "--coordinator: HOST:PORT of the rendezvous, which is Tide's coordinator",
    "--rank": "--pod-index: this node's index (ranks are given per generation)",
    "--host": "--host: the address the other workers reach this pod's at",
    "--devices": "CUDA_VISIBLE_DEVICES of the launcher: the GPUs this pod's workers share out",
    "--gpus": "the same as --devices",
    "--log_level": "--log-level",
    "--run_mode": "collective only (the mode Tide's session trains in)",
    "--elastic_level": "accepted: every Tide job is elastic within --nnodes",
}

REFUSED: dict[str, str] = {
    "--legacy": "Tide has one launcher; the legacy one is Paddle's",
    "--log_overwrite": "Tide never overwrites a worker log: each generation writes its own",
    "--sort_ip": "ranks come from the coordinator each generation, not from sorted IPs",
    "--enable_gpu_log": "GPU logs are Paddle's launcher's; use the node agent's telemetry",
    "--ips": "no fixed host list: each pod registers itself with the coordinator",
    "--start_port": "ports are picked free per generation and reported at registration",
    "--npus": "Tide's workers run on CPUs or NVIDIA GPUs only",
    "--xpus": "Tide's workers run on CPUs or NVIDIA GPUs only",
    "--auto_parallel_config": "auto-parallel plans a fixed world size; Tide's changes",
    "--auto_cluster_config": "auto-parallel plans a fixed world size; Tide's changes",
    "--auto_tuner_json": "the auto-tuner restarts jobs at sizes it chooses; the scaler does",
    "--servers": "parameter-server mode is not elastic under Tide (collective only)",
    "--trainers": "parameter-server mode is not elastic under Tide (collective only)",
    "--trainer_num": "parameter-server mode is not elastic under Tide (collective only)",
    "--server_num": "parameter-server mode is not elastic under Tide (collective only)",
    "--gloo_port": "the gloo store is the generation's master, picked by the coordinator",
    "--with_gloo": "the backend is chosen by --backend (gloo on CPU, nccl on GPUs)",
    "--max_restart": "restarts are the coordinator's (crash-loop policy, docs/preemption.md)",
    "--elastic_timeout": "the coordinator forms a generation once --nnodes' minimum is there",
}

# tide.trainer.launch's own flags that take no value (every other one takes one).
_TIDE_SWITCHES = frozenset({"--no-zygote", "--no-prewarm", "--no-handover", "-h", "--help"})
_PRINT_JOB = "--print-job"


class LaunchArgsRefused(ConfigError):
    """Paddle arguments Tide cannot honour: one line each (``lines``)."""

    def __init__(self, lines: Sequence[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = tuple(lines)


@dataclasses.dataclass(frozen=True)
class Translated:
    """A Paddle-style command line as tide.trainer.launch's: its argv (``--`` and the command
    included), the job's bounds from ``--nnodes``, and environment the launcher sets."""

    argv: tuple[str, ...]
    min_replicas: int | None = None
    max_replicas: int | None = None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    print_job: bool = False

    def job_document(self, job_id: str) -> str:
        """The ``tide job apply -f -`` document that gives the job ``--nnodes``' bounds."""
        lo = self.min_replicas or 1
        hi = self.max_replicas or lo
        return (
            f"job_id: {job_id}\ninitial_replicas: {lo}\n"
            f"policy:\n  min_replicas: {lo}\n  max_replicas: {hi}\n"
        )


def is_paddle_style(argv: Sequence[str]) -> bool:
    """True for a ``paddle.distributed.launch`` command line (no ``--``, a script named)."""
    return _split(argv)[1] is not None


def _split(argv: Sequence[str]) -> tuple[list[tuple[str, str | None]], str | None, list[str]]:
    """(flags with their values, the script, its args): the first bare word is the script."""
    flags: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":  # Tide's own form: the command follows
            return flags, None, []
        if not tok.startswith("-"):
            return flags, tok, list(argv[i + 1 :])
        if "=" in tok:
            name, value = tok.split("=", 1)
            flags.append((name, value))
        elif tok in _TIDE_SWITCHES or tok == _PRINT_JOB:
            flags.append((tok, None))
        else:
            flags.append((tok, argv[i + 1] if i + 1 < len(argv) else None))
            i += 1
        i += 1
    return flags, None, []


def _bounds(value: str) -> tuple[int, int]:
    lo, _, hi = value.partition(":")
    try:
        mn, mx = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nnodes {value}: expected N or MIN:MAX (integers)") from None
    if not 1 <= mn <= mx:
        raise ConfigError(f"--nnodes {value}: expected 1 <= MIN <= MAX")
    return mn, mx


def translate(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Translated:
    """``argv`` (Paddle-style, see ``is_paddle_style``) as tide.trainer.launch's own argv.

    Raises ``LaunchArgsRefused`` listing every argument Tide cannot honour, one line each.
    """
    env_in = os.environ if environ is None else environ
    flags, script, script_args = _split(argv)
    if script is None:
        raise ConfigError("no training script: python -m tide.trainer.launch [FLAGS] train.py ARGS")
    out: list[str] = []
    refused: list[str] = []
    env: dict[str, str] = {}
    lo = hi = None
    print_job = False
    for name, value in flags:
        if name in REFUSED:
            refused.append(f"{name}: {REFUSED[name]}")
            continue
        if name == _PRINT_JOB:
            print_job = True
            continue
        if name not in ACCEPTED:
            out.append(name) if value is None else out.extend((name, value))
            continue
        if value is None:
            refused.append(f"{name}: needs a value")
        elif name == "--nnodes":
            lo, hi = _bounds(value)
        elif name == "--nproc_per_node":
            out += ["--workers-per-pod", value]
        elif name == "--log_dir":
            out += ["--state-dir", value]
        elif name == "--job_id":
            ns = env_in.get("POD_NAMESPACE", "default")
            out += ["--job", value if "/" in value else f"{ns}/{value}"]
        elif name == "--master":
            if "://" in value:
                refused.append(
                    f"--master {value}: the rendezvous is Tide's coordinator (HOST:PORT)"
                )
            else:
                out += ["--coordinator", value]
        elif name == "--rank":
            if value.lstrip("-").isdigit() and int(value) >= 0:
                out += ["--pod-index", value]
        elif name == "--host":
            out += ["--host", value]
        elif name in ("--devices", "--gpus"):
            if env_in.get("CUDA_VISIBLE_DEVICES", value) != value:
                refused.append(f"{name} {value}: CUDA_VISIBLE_DEVICES is set too; keep one")
            else:
                env["CUDA_VISIBLE_DEVICES"] = value
        elif name == "--log_level":
            out += ["--log-level", value]
        elif name == "--run_mode" and value != "collective":
            refused.append(f"--run_mode {value}: Tide trains collectively only")
        # --elastic_level: nothing to do (ACCEPTED says why).
    if refused:
        raise LaunchArgsRefused(refused)
    # No "-u": the zygote forks `python SCRIPT ARGS` only (tide/trainer/spawner.py).
    command = [sys.executable, script, *script_args]
    return Translated(
        argv=(*out, "--", *command),
        min_replicas=lo,
        max_replicas=hi,
        env=env,
        print_job=print_job,
    )
