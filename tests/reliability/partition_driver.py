"""The partition tests' driver, run *inside* the server namespace (tests/support/netns.py):
``ip netns exec SERVER_NS python -m tests.reliability.partition_driver LINK SERVER_NS CLIENT_NS
SERVER_DEV CLIENT_DEV``.

The services of one side of the link run here, beside this driver, and it reads
them over this namespace's loopback, which a partition does not touch; the other
side runs in the client namespace and is read from its log. The driver cuts and
heals the link itself, so every figure is measured on one clock. Its last line is
``RESULT {json}``; the pytest side (test_partitions.py) checks the bounds.
"""

import asyncio
import json
import sys

from tests.reliability.partition_kube_link import apiserver_peer, scaler_apiserver
from tests.reliability.partition_links import (
    agent_scaler,
    coordinator_peer,
    launcher_coordinator,
    launcher_peer,
    scaler_coordinator,
)
from tests.support.netns import NetnsPair

LINKS = {
    "agent-scaler": agent_scaler,
    "scaler-coordinator": scaler_coordinator,
    "launcher-coordinator": launcher_coordinator,
    "scaler-apiserver": scaler_apiserver,
}


def main(argv: list[str]) -> None:
    if argv[0] == "coordinator-peer":
        asyncio.run(coordinator_peer(argv[1], launchers=3))
        return
    if argv[0] == "apiserver-peer":
        asyncio.run(apiserver_peer(argv[1]))
        return
    if argv[0] == "launcher-peer":
        asyncio.run(launcher_peer(argv[1], int(argv[2])))
        return
    link, server, client, server_dev, client_dev, db_url = argv
    pair = NetnsPair(server, client, server_dev, client_dev)
    result = LINKS[link](pair, db_url)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
