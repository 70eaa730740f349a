"""``dufu lighthouse``: the coordinator of fault-tolerant replica groups (torchft's Lighthouse server).

It forms the quorums: which replica groups (``dufu train`` jobs with ``train.fault_tolerance.enabled=True``) take
the next step together. It holds no training state; it is a small server that should outlive the groups (run it
on a machine that is not preempted). Runs until SIGINT or SIGTERM. docs/faults.md
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from dufu.cli import require_package
from dufu.engine.resilience.fault_tolerance import DEFAULT_PORT
from dufu.errors import DufuError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dufu lighthouse",
        description="Start the Lighthouse that forms quorums of fault-tolerant replica groups (torchft). The "
                    "groups find it through train.fault_tolerance.lighthouse=http://HOST:PORT.")
    parser.add_argument("--bind", default=f"[::]:{DEFAULT_PORT}",
                        help=f"address and port to listen on (default [::]:{DEFAULT_PORT}; port 0: any free port)")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="the fewest replica groups a quorum may have (default 1: train on while any group lives)")
    parser.add_argument("--join-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long a quorum waits for groups that are alive but have not asked to join yet "
                             "(default 60)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="a group silent this long is taken for dead (default 5)")
    parser.add_argument("--quorum-tick", type=float, default=0.1, metavar="SECONDS",
                        help="how often the quorum is reconsidered (default 0.1)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.min_replicas < 1:
        raise DufuError(f"--min-replicas {args.min_replicas}: a quorum needs at least 1 replica group.")
    for name in ("join_timeout", "heartbeat_timeout", "quorum_tick"):
        if getattr(args, name) <= 0:
            raise DufuError(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number of seconds.")
    require_package("torchft", "lighthouse")
    os.environ.setdefault("RUST_LOG", "warn")  # RUST_LOG=info: a log line per quorum
    from torchft.coordination import LighthouseServer  # torchft is an optional dependency (dufu[ft])
    try:
        server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                  join_timeout_ms=int(args.join_timeout * 1000),
                                  quorum_tick_ms=int(args.quorum_tick * 1000),
                                  heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000))
    except Exception as e:  # a taken port, a bad address
        raise DufuError(f"the Lighthouse could not listen on {args.bind}: {e}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"dufu lighthouse: listening on {args.bind}, reachable as {server.address()} (min {args.min_replicas} "
          f"replica group(s), join timeout {args.join_timeout:g} s); the groups' config: "
          f"train.fault_tolerance.lighthouse={server.address()}", flush=True)
    stop.wait()
    server.shutdown()
    print("dufu lighthouse: stopped", flush=True)
    return 0
