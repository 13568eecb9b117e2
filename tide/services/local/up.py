"""`tide up`: the whole control plane on this machine, in the foreground.

Layout of the state dir (default ./.tide):

    tide.db          SQLite store of the scaler and the coordinator
    logs/            one log per service and per local pod
    jobs/<ns>__<n>/  each local job's spec, wanted replicas and pod pid files
    pods/<pod>/      each launcher's own state (worker logs)
    checkpoints/     where `tide demo` points its job's checkpoints
    pki/             the CA and certificates made at each start (unless --insecure)
    up.lock          held while a `tide up` or `tide demo` runs on the dir

Every link runs mTLS (docs/security.md): at start a fresh CA under pki/ issues the
server certificate the scaler and the coordinator share, the scaler's, each
agent's (its node) and an admin user's for the CLI and the demo; the scaler's
local actuator issues each pod's launcher certificate as it starts the pod.
``--insecure`` runs every link plaintext instead, with the services' warning.

Start order: coordinator, scaler (``python -m tide.services.scaler --actuator local:DIR``), then the optional
node agents (``python -m tide.services.agent --source synthetic``), each with a
stand-in kubelet PodResources socket (tide/services/local/kubelet.py) that says
which local pod holds which of its GPUs. Stop order, on SIGINT/SIGTERM or when
a service dies: the agents (together), the scaler (no new decisions), the local
pods (a job's at once), coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc

from tide.base.credentials import CLIENT_ENV, NO_CREDENTIALS, ClientCredentials
from tide.base.errors import ConfigError, FailedPrecondition
from tide.services.common.pki import CertificateAuthority, Issued
from tide.services.local.kubelet import serve_pod_resources
from tide.services.local.load import LoadSettings, SyntheticNode
from tide.services.local.supervisor import Child, ChildSpec, Supervisor
from tide.services.scaler.actuators.local import LocalActuator, LocalActuatorSettings

logger = logging.getLogger(__name__)

PY = sys.executable


def _hostport(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{name}: expected HOST:PORT, got {value!r}")


@dataclass(frozen=True)
class UpSettings:
    state_dir: Path = Path(".tide")
    scaler_listen: str = "127.0.0.1:50051"
    coordinator_listen: str = "127.0.0.1:50052"
    # Node agents with synthetic GPUs streaming to the scaler (0: none).
    agents: int = 0
    gpus_per_agent: int = 4
    # Utilization the agents' synthetic GPUs report, percent.
    load_pct: float = 50.0
    # GPUs the local actuator offers (0: unknown, no capacity limit).
    total_gpus: int = 0
    log_level: str = "INFO"
    # text or json, for the services and (through TIDE_LOG_FORMAT) the local pods' launchers.
    log_format: str = "text"
    # Extra flags, e.g. the default policy: ("--sustain-s", "10", ...).
    scaler_flags: tuple[str, ...] = ()
    coordinator_flags: tuple[str, ...] = ()
    stop_grace_s: float = 15.0
    ready_timeout_s: float = 90.0
    # mTLS on every link with a CA made at start; False: plaintext, services --insecure.
    tls: bool = True
    # A file holding an admin token: the services require it for admin calls (and the
    # scaler presents it to the coordinator). Passed in the environment, never in argv.
    admin_token_file: Path | None = None

    def __post_init__(self) -> None:
        _hostport("scaler_listen", self.scaler_listen)
        _hostport("coordinator_listen", self.coordinator_listen)
        if not 0 <= self.agents <= 16:
            raise ConfigError(f"agents: must be 0..16, got {self.agents}")
        if not 0 <= self.load_pct <= 100:
            raise ConfigError(f"load_pct: must be 0..100, got {self.load_pct}")
        if self.total_gpus < 0:
            raise ConfigError(f"total_gpus: must be >= 0, got {self.total_gpus}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format: expected text or json, got {self.log_format!r}")
        LoadSettings(gpus=self.gpus_per_agent)
        if self.admin_token_file is not None and not self.admin_token_file.is_file():
            raise ConfigError(f"admin_token_file: no such file {str(self.admin_token_file)!r}")

    @property
    def db_url(self) -> str:
        return f"sqlite:///{(self.state_dir / 'tide.db').resolve()}"


def lock_state_dir(state_dir: Path) -> IO[str]:
    """Hold ``state_dir/up.lock`` for the life of the returned file: one control plane per dir."""
    state_dir.mkdir(parents=True, exist_ok=True)
    f = open(state_dir / "up.lock", "a+")  # noqa: SIM115 - held until close
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise FailedPrecondition(
            f"another `tide up` or `tide demo` is running on {state_dir} (it holds up.lock)"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


@dataclass
class LocalCluster:
    """The running control plane; ``start`` then ``stop`` (also after a failed start)."""

    settings: UpSettings
    supervisor: Supervisor = field(init=False)
    actuator: LocalActuator | None = None
    coordinator: Child | None = None
    scaler: Child | None = None
    nodes: list[SyntheticNode] = field(default_factory=list)
    agents: list[Child] = field(default_factory=list)
    _kubelets: list[grpc.aio.Server] = field(default_factory=list)
    _node_stop: asyncio.Event = field(default_factory=asyncio.Event)
    _node_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _lock: IO[str] | None = None
    ca: CertificateAuthority | None = None
    admin: Issued | None = None
    _server: Issued | None = None
    _scaler: Issued | None = None

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(self.settings.state_dir / "logs")

    def credentials(
        self, issued: Issued | None = None, *, admin_token: bool = False
    ) -> ClientCredentials:
        """What a local client presents: ``issued`` (default: the admin user's) with the
        CA; with ``admin_token``, also the admin token file if there is one (the
        scaler's link and the demo's own calls; agents and launchers prove who they
        are with their certificates alone)."""
        token = str(self.settings.admin_token_file or "") if admin_token else ""
        if self.ca is None:
            return ClientCredentials(token_file=token) if token else NO_CREDENTIALS
        issued = issued or self.admin
        assert issued is not None
        return self.ca.credentials(issued, token_file=token)

    def _env(self) -> dict[str, str]:
        """Every service's environment: the mode, the admin token, and none of the
        caller's own client credentials (TIDE_TLS_CA_FILE... are a CLI user's)."""
        env = dict.fromkeys(CLIENT_ENV, "")
        env["TIDE_INSECURE"] = "0" if self.ca is not None else "1"
        if self.settings.admin_token_file is not None:
            env["TIDE_ADMIN_TOKEN"] = self.settings.admin_token_file.read_text().strip()
        return env

    def _server_flags(self) -> tuple[str, ...]:
        if self.ca is None or self._server is None:
            return ()
        return (
            "--tls-cert-file",
            self._server.cert_file,
            "--tls-key-file",
            self._server.key_file,
            "--tls-client-ca-file",
            self.ca.ca_file,
        )

    @staticmethod
    def _client_flags(creds: ClientCredentials) -> tuple[str, ...]:
        pairs = (
            ("--tls-ca-file", creds.tls_ca_file),
            ("--tls-client-cert-file", creds.tls_client_cert_file),
            ("--tls-client-key-file", creds.tls_client_key_file),
            ("--token-file", creds.token_file),
        )
        return tuple(x for flag, value in pairs if value for x in (flag, value))

    def _make_pki(self) -> None:
        pki = (self.settings.state_dir / "pki").resolve()
        self.ca = CertificateAuthority.create(pki)
        self._server = self.ca.server()
        self._scaler = self.ca.scaler()
        self.admin = self.ca.user("local", "admin")

    @property
    def scaler_target(self) -> str:
        assert self.scaler is not None
        return self.scaler.target

    @property
    def coordinator_target(self) -> str:
        assert self.coordinator is not None
        return self.coordinator.target

    async def start(self) -> None:
        s = self.settings
        self._lock = lock_state_dir(s.state_dir)
        (s.state_dir / "checkpoints").mkdir(exist_ok=True)
        if s.tls:
            self._make_pki()
        env = self._env()
        self.coordinator = await self.supervisor.start(
            ChildSpec(
                "coordinator",
                (
                    PY,
                    "-m",
                    "tide.services.coordinator",
                    "--listen",
                    s.coordinator_listen,
                    "--db",
                    s.db_url,
                    "--log-level",
                    s.log_level,
                    "--log-format",
                    s.log_format,
                    *self._server_flags(),
                    *s.coordinator_flags,
                ),
                env=env,
                ready_timeout_s=s.ready_timeout_s,
                stop_grace_s=s.stop_grace_s,
            )
        )
        self.actuator = LocalActuator(
            LocalActuatorSettings(
                state_dir=s.state_dir,
                coordinator=self.coordinator_target,
                total_gpus=s.total_gpus or None,
            )
        )
        self.scaler = await self.supervisor.start(
            ChildSpec(
                "scaler",
                (
                    PY,
                    "-m",
                    "tide.services.scaler",
                    "--listen",
                    s.scaler_listen,
                    "--db",
                    s.db_url,
                    "--coordinator",
                    self.coordinator_target,
                    "--actuator",
                    f"local:{s.state_dir.resolve()}",
                    "--total-gpus",
                    str(s.total_gpus),
                    "--log-level",
                    s.log_level,
                    "--log-format",
                    s.log_format,
                    *self._server_flags(),
                    *self._client_flags(self.credentials(self._scaler, admin_token=True)),
                    *(("--local-ca-dir", str(self.ca.dir)) if self.ca else ()),
                    *s.scaler_flags,
                ),
                # The local actuator's launchers inherit the scaler's environment.
                env={**env, "TIDE_LOG_FORMAT": s.log_format},
                ready_timeout_s=s.ready_timeout_s,
                stop_grace_s=s.stop_grace_s,
            )
        )
        for k in range(s.agents):
            await self.start_agent(k)

    async def start_agent(self, k: int) -> Child:
        """Node agent ``local-k`` with synthetic GPUs, attributed by a stand-in kubelet."""
        s = self.settings
        assert self.actuator is not None
        sock = (s.state_dir / f"kubelet-{k}.sock").resolve()
        creds = self.credentials(self.ca.agent(f"local-{k}") if self.ca else None)
        self._kubelets.append(
            await serve_pod_resources(sock, _slice_of_pods(self.actuator, k, s.gpus_per_agent))
        )
        child = await self.supervisor.start(
            ChildSpec(
                f"agent-{k}",
                (
                    PY,
                    "-m",
                    "tide.services.agent",
                    "--scaler",
                    self.scaler_target,
                    "--node-name",
                    f"local-{k}",
                    "--source",
                    "synthetic",
                    "--synthetic-profile",
                    f"steady:{s.load_pct:g}",
                    "--synthetic-gpus",
                    str(s.gpus_per_agent),
                    "--pod-resources-socket",
                    str(sock),
                    "--pod-resources-refresh-s",
                    "1",
                    "--no-watch-node",
                    "--log-level",
                    s.log_level,
                    "--log-format",
                    s.log_format,
                    *self._client_flags(creds),
                ),
                env=self._env(),
                wait_listening=False,
                stop_grace_s=s.stop_grace_s,
            )
        )
        self.agents.append(child)
        return child

    def add_node(
        self,
        settings: LoadSettings,
        attribution: Callable[[], Mapping[int, tuple[str, str]]],
        level_pct: float,
    ) -> SyntheticNode:
        issued = self.ca.agent(settings.node_name) if self.ca is not None else None
        node = SyntheticNode(
            self.scaler_target, attribution, settings, credentials=self.credentials(issued)
        )
        node.level_pct = level_pct
        self.nodes.append(node)
        self._node_tasks.append(
            asyncio.create_task(node.run(self._node_stop), name=f"node-{settings.node_name}")
        )
        return node

    async def wait(self, stop: asyncio.Event) -> Child | None:
        """Until ``stop`` is set (None) or a service exits (that child)."""
        stopper = asyncio.create_task(stop.wait())
        dead = asyncio.create_task(self.supervisor.wait_any_exit())
        try:
            await asyncio.wait({stopper, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not dead.done():
                dead.cancel()
        return dead.result() if dead.done() and not dead.cancelled() else None

    def _pods_running(self) -> bool:
        a = self.actuator
        return a is not None and any(a.pods(job) for job in a.jobs())

    async def stop(self) -> dict[str, int]:
        self._node_stop.set()
        for t in self._node_tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(t, 5)
        # The agents before the scaler: each sends its final report and ends its
        # Telemetry stream while the scaler still serves it. Stopped together, an agent
        # ended its stream as the scaler's server was stopping, and gRPC logged "Aborting
        # method [/tide.v1.Telemetry/Stream] due to server stop" (a WARNING) in a healthy
        # run. The agents together (one wait, not one per agent), then the scaler; the
        # coordinator outlives the pods, so that they leave it rather than lose it; with
        # no pod running it goes with the scaler.
        codes: dict[str, int] = {}
        for group in (
            list(reversed(self.agents)),
            [
                *([self.scaler] if self.scaler is not None else []),
                *(
                    [self.coordinator]
                    if self.coordinator is not None and not self._pods_running()
                    else []
                ),
            ],
        ):
            exits = await asyncio.gather(*(self.supervisor.stop(c) for c in group))
            codes.update({c.name: code for c, code in zip(group, exits, strict=True)})
        for server in self._kubelets:
            await server.stop(0)
        if self.actuator is not None:
            await self.actuator.stop_all()
        codes.update(await self.supervisor.stop_all())
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        return codes


def _slice_of_pods(
    actuator: LocalActuator, node_index: int, gpus: int
) -> Callable[[], dict[int, tuple[str, str]]]:
    """Node k holds GPUs k*gpus..(k+1)*gpus-1 of all local pods, in (job, index) order."""

    def owners() -> dict[int, tuple[str, str]]:
        pods = [(job, p) for job in actuator.jobs() for p in actuator.pods(job)]
        mine = pods[node_index * gpus : (node_index + 1) * gpus]
        return {i: (job.partition("/")[0], p.name) for i, (job, p) in enumerate(mine)}

    return owners


def banner(cluster: LocalCluster) -> list[str]:
    s = cluster.settings
    lines = [
        f"READY scaler={cluster.scaler_target} coordinator={cluster.coordinator_target}",
        f"  store   {s.db_url}",
        f"  logs    {s.state_dir / 'logs'}",
    ]
    creds = cluster.credentials()
    if creds.tls:
        lines += [
            f"  mTLS    CA and certificates in {s.state_dir / 'pki'}; as admin:",
            *(f"          export {k}={v}" for k, v in creds.env().items()),
        ]
    else:
        lines.append("  INSECURE: every link is plaintext and unauthenticated")
    lines += [
        f"  try     tide jobs --scaler {cluster.scaler_target}",
        f"          tide history all --db {s.db_url}",
    ]
    if cluster.agents:
        lines.append(
            f"  {len(cluster.agents)} node agent(s) x {s.gpus_per_agent} synthetic GPUs"
            f" at {s.load_pct:g}%"
        )
    lines.append("Ctrl-C stops everything.")
    return lines


async def up(settings: UpSettings, echo: Callable[[str], None], stop: asyncio.Event) -> int:
    """Run until ``stop`` is set (0) or a service dies (1). A stop during start-up is honoured."""
    cluster = LocalCluster(settings)
    try:
        starting = asyncio.create_task(cluster.start())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            echo("interrupted while starting; stopping what started")
            return 0
        starting.result()
        for line in banner(cluster):
            echo(line)
        dead = await cluster.wait(stop)
        if dead is not None:
            echo(
                f"{dead.name} exited with code {dead.proc.returncode}; stopping everything"
                f" (see {dead.log_path})"
            )
            return 1
        echo("stopping: agents, scaler, local pods, coordinator")
        return 0
    finally:
        codes = await cluster.stop()
        if codes:
            echo("stopped " + ", ".join(f"{k} ({v})" for k, v in codes.items()))


def split_flags(values: Sequence[str]) -> tuple[str, ...]:
    """``["--sustain-s 10", "--bucket-s=2"]`` → ``("--sustain-s", "10", "--bucket-s=2")``."""
    return tuple(part for v in values for part in shlex.split(v))
