"""The local launcher's torchrun rendezvous settings: fast recovery without split brain.

Each is a trade-off, measured on this project's loaded 2-core machine:
- LAST_CALL_TIMEOUT_S, 2 s: once the fewest agents allowed are in, wait this long for more. torch's 30 s
  is added to every regroup; too short and agents restarted together land in different rounds. It must
  also exceed the time a worker needs to save on SIGTERM, or a joining agent forms a round before the
  others arrive (one extra regroup).
- KEEP_ALIVE_INTERVAL_S x KEEP_ALIVE_MAX_ATTEMPT, 2 s x 3: a lost node is declared dead after ~6 s (torch:
  5 s x 3 = 15 s). 1 s x 2 regrouped in ~4 s, but a busy agent that missed heartbeats split the job in
  two. Dead nodes are noticed on this heartbeat grid, so recovery after a node loss varies by up to one
  interval with the moment of the loss (the recovery benchmark kills on fixed phases of it).
- JOIN_TIMEOUT_S, 600 s: how long a rendezvous may take to form (torch's default, spelled out).
- MAX_RESTARTS, 100: every membership change restarts the group, and counts against it on the agents that
  survive.
- MONITOR_INTERVAL_S, 0.5 s: how fast an agent notices a dead worker; cheap.
"""

from __future__ import annotations

LAST_CALL_TIMEOUT_S = 2
KEEP_ALIVE_INTERVAL_S = 2
KEEP_ALIVE_MAX_ATTEMPT = 3
JOIN_TIMEOUT_S = 600
MAX_RESTARTS = 100
MONITOR_INTERVAL_S = 0.5


def rdzv_conf(is_host: bool) -> str:
    """torchrun's `--rdzv_conf` for one agent; `is_host`: the one agent on this host that holds the c10d
    store (torch 2.13 would otherwise let every same-host agent believe it hosts it)."""
    return (
        f"is_host={int(is_host)},last_call_timeout={LAST_CALL_TIMEOUT_S},"
        f"keep_alive_interval={KEEP_ALIVE_INTERVAL_S},keep_alive_max_attempt={KEEP_ALIVE_MAX_ATTEMPT},"
        f"join_timeout={JOIN_TIMEOUT_S}"
    )
