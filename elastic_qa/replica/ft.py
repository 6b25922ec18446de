"""torchft, behind one module: the only place the product imports it (tests/test_layers.py says so).

torchft is young (0.2.0 is what installs beside torch 2.13 and what this was written against): its Manager's
arguments, its transport interface and its Lighthouse binary have changed between releases. Every use goes
through the few functions here, which refuse any other version with one line, so an upgrade is one module
to read again. What the product takes from it: the Lighthouse (which replica groups form the next quorum),
the Manager (quorum per step, the cross-group all-reduce, the commit vote `should_commit`, which peer heals
whom) and its reconfigurable gloo process group. What it does not take: torchft's HTTP heal transport, which
unpickles a peer's bytes (`SafeTransport` below sends the product's own checksummed, `weights_only` payload
instead: replica/heal.py), its data sampler (the product's global cursor splits each step's batch over the
quorum instead: replica/shares.py) and its step counter as a fencing token (it lives in the Lighthouse's
memory).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic_qa.config import ConfigError, ReplicaConfig

PINNED = "0.2.0"


def require_torchft() -> None:
    """ConfigError (exit 2) unless torchft PINNED is installed: the replica mode is an optional extra."""
    try:
        found = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"the replica-group mode needs torchft {PINNED}: pip install 'elastic-qa[torchft]'"
        ) from None
    if found != PINNED:
        raise ConfigError(
            f"the replica-group mode is written against torchft {PINNED}, and torchft {found} is installed: "
            f"pip install 'torchft=={PINNED}'"
        )


# torchft's Lighthouse is its Rust extension alone, which links no libtorch: it is loaded here without the
# torchft package, whose __init__ imports torch (2 s of CPU on an idle 2-core host, up to 15 s loaded, where
# this takes 30 ms), from the installed package only (the working directory is dropped from the path: a
# `torchft` another user left there must not be found). argv: mode (serve: bind at once; standby: print
# `ready`, bind on reading `serve`), then bind, min replicas, join timeout ms, quorum tick ms, heartbeat
# timeout ms.
_LIGHTHOUSE = """import sys
if sys.path and sys.path[0] in ("", "."):  # `python -c` puts the working directory first: not trusted
    del sys.path[0]
import importlib.machinery, importlib.util, pathlib, signal
package = importlib.util.find_spec("torchft")
folder = pathlib.Path(package.submodule_search_locations[0])
# The build this interpreter would import (its own suffix), not any other that lies beside it.
path = str(next(folder / f"_torchft{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
                if (folder / f"_torchft{suffix}").is_file()))
loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", path)
extension = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader, origin=path))
loader.exec_module(extension)
mode, bind, replicas, join_ms, tick_ms, heartbeat_ms = sys.argv[1:]
if mode == "standby":
    print("ready", flush=True)
if mode == "serve" or sys.stdin.readline().strip() == "serve":
    server = extension.LighthouseServer(bind=bind, min_replicas=int(replicas), join_timeout_ms=int(join_ms),
                                        quorum_tick_ms=int(tick_ms), heartbeat_timeout_ms=int(heartbeat_ms))
    signal.pause()
"""


def lighthouse_command(
    port: int, settings: ReplicaConfig, host: str = "127.0.0.1", standby: bool = False
) -> list[str]:
    """The command line of a Lighthouse on `host:port` with the job's quorum settings. `standby`: one
    started ahead of need, which prints `ready` and binds on reading `serve` (the launcher keeps one beside
    the Lighthouse that serves and promotes it when that one dies)."""
    return [
        sys.executable, "-c", _LIGHTHOUSE, "standby" if standby else "serve", f"{host}:{port}",
        str(settings.min_replicas), str(_ms(settings.join_timeout)), "50",
        str(_ms(settings.heartbeat_timeout)),
    ]  # fmt: skip


def _ms(delta: timedelta) -> int:
    return max(1, int(delta.total_seconds() * 1000))


INCARNATION_ENV = "ELASTIC_QA_LIGHTHOUSE_INCARNATION"  # the file a group reads its Lighthouse's start from
INCARNATION_SPAN = 10**9  # quorum ids of a Lighthouse incarnation n > 1 are (n - 1) * SPAN + torchft's id
QUORUM_FIELDS = (
    "quorum_id", "replica_rank", "replica_world_size", "recover_src_manager_address",
    "recover_src_replica_rank", "recover_dst_replica_ranks", "store_address", "max_step", "max_replica_rank",
    "max_world_size", "heal", "replica_ids",
)  # fmt: skip


class LighthouseIncarnation:
    """Which start of the job's Lighthouse answers now, read from the file its launcher writes before each
    start (`{"incarnation": n}`, replaced atomically).

    A restarted Lighthouse numbers its quorums from 1 again, and torchft reconfigures its cross-group process
    group only when the quorum id changes: a group whose last quorum under the old Lighthouse had the id the
    new one gives next kept a process group wired to its old peers, and the step hung until the collective
    timeout (measured: 3 of 10 Lighthouse kills cost 11-51 s). Every group reads the same incarnation for
    the same quorum (the file is written before the Lighthouse that answers starts), so ids made unique per
    incarnation make every member reconfigure together. The file is read again only when it changed (one
    stat per quorum), and only a file of this user is trusted."""

    def __init__(self, path: str | None) -> None:
        self.path, self.value = path, 1
        self._seen: tuple[int, int, int] | None = None

    def current(self) -> int:
        if not self.path:
            return self.value
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return self.value
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen != self._seen and stat.st_uid == os.getuid():
            try:
                with open(self.path) as handle:
                    self.value = int(json.load(handle)["incarnation"])
                self._seen = seen
            except (OSError, ValueError, KeyError, TypeError):
                pass  # torn or foreign: keep the last one read, and read it again next time
        return self.value

    @staticmethod
    def write(path: Path, incarnation: int) -> None:
        """The launcher's side: record that start `incarnation` of the Lighthouse answers from now on (called
        before that Lighthouse starts)."""
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps({"incarnation": incarnation}))
        os.replace(temporary, path)

    def quorum_id(self, torchft_id: int) -> int:
        return (self.current() - 1) * INCARNATION_SPAN + torchft_id


class _IncarnationClient:
    """torchft's ManagerClient, its quorums' ids made unique across Lighthouse restarts."""

    def __init__(self, client: Any, incarnation: LighthouseIncarnation) -> None:
        self._client, self._incarnation = client, incarnation

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        fields = {name: getattr(result, name) for name in QUORUM_FIELDS}
        fields["quorum_id"] = self._incarnation.quorum_id(int(result.quorum_id))
        return types.SimpleNamespace(**fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def forget_manager_address(host: str, port: int, group_rank: int, timeout: timedelta) -> None:
    """Delete the address of the group's torchft manager that an earlier torchrun attempt's rank 0 left in
    the agent's store, before any worker of this attempt reads it (collective over the group's workers).

    torchft's Manager keeps it under one key of the raw store (rank 0 sets it, the others read it), and torch
    2.13's agent keeps its store across restarts: a restarted worker that reads first would otherwise reach
    for the dead manager of the attempt before. Rank 0 deletes it, and no worker goes on before it has."""
    import torch.distributed as dist
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    if group_rank == 0:
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            client.delete_key(key)
    dist.barrier()


@dataclass(frozen=True)
class Quorum:
    """What one step's quorum says about this replica group."""

    participants: int  # replica groups taking part in this step (a group that heals in it does not)
    rank: int | None  # this group's place among them (0 .. participants - 1); None: it heals in this step
    quorum_id: int
    members: int = 0  # replica groups in the quorum, those that heal in this step included

    @property
    def heals(self) -> bool:
        """This group sits the step out: it receives a live peer's state at the vote, and then takes the
        step with its peers' summed gradients."""
        return self.rank is None


class ReplicaManager:
    """torchft's Manager for one worker of one replica group: the calls the replica loop makes per step.

    `state` and `load_state` are the whole training state (the checkpoint's files), sent to a peer that
    heals from this group and applied when this group heals; `transport` carries them (SafeTransport)."""

    def __init__(
        self,
        settings: ReplicaConfig,
        group: int,
        lighthouse: str,
        state: Callable[[], dict[str, Any]],
        load_state: Callable[[dict[str, Any]], None],
        transport: Any,
        group_rank: int = 0,
        group_world_size: int = 1,
        store: tuple[str, int] | None = None,
        incarnation_file: str | None = None,
        hostname: str | None = None,
    ) -> None:
        require_torchft()
        from torchft import Manager, ProcessGroupGloo

        collective = settings.collective_timeout
        self.pg = ProcessGroupGloo(timeout=collective)
        host, port = store or (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        if group_world_size > 1:
            forget_manager_address(host, port, group_rank, collective)
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=load_state,
            state_dict=state,
            min_replica_size=settings.min_replicas,
            # The quorum is computed (and a heal fetched) while the step trains: the loop trains the last
            # quorum's share before it knows this one, and a group that heals sits its heal step out.
            use_async_quorum=True,
            timeout=collective,
            quorum_timeout=settings.quorum_timeout,
            connect_timeout=collective,
            rank=group_rank,
            world_size=group_world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse,
            replica_id=f"group-{group}",
            heartbeat_interval=timedelta(milliseconds=100),
            checkpoint_transport=transport,
            init_sync=False,  # every group builds the same weights from run.seed
            quorum_retries=settings.quorum_retries,
            # The address the other groups reach this one's manager at (torchft: this host's name, which may
            # resolve to loopback); `elastic-qa node --replicas` gives the host's address on the network.
            **({"hostname": hostname} if hostname else {}),
        )
        self.manager._client = _IncarnationClient(
            self.manager._client, LighthouseIncarnation(incarnation_file)
        )

    def begin_step(self) -> None:
        """Ask for the next step's quorum without waiting for it: torchft computes it in the background (and
        sends a peer this group's state, or fetches this group's from a peer, when the quorum says so)."""
        self.manager.start_quorum()

    def quorum(self) -> Quorum:
        """Wait for the quorum begin_step asked for. A group that is behind the quorum's newest members heals
        from one of them: it takes no part in this step, and its peer's state is applied at the vote."""
        self.manager.wait_quorum()
        participants = self.manager.num_participants()
        rank = self.manager.participating_rank()
        try:
            members = self.pg.size()  # the cross-group group, configured for the whole quorum
        except AssertionError:  # its configuration failed: the vote says no anyway
            members = participants
        return Quorum(participants, rank, int(self.manager._quorum_id), members)

    def sum_across_groups(self, flat: Any) -> None:
        """Sum `flat` over the quorum's groups in place (a failed peer is recorded, not raised: the vote
        then says no)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()

    def commit(self) -> bool:
        """The commit vote: True only when every worker of this group got through the step (a failed sum
        with another group is an error here too). A group that heals applies its peer's state first."""
        return bool(self.manager.should_commit())

    @property
    def position(self) -> int:
        """torchft's step counter, which the product uses as its position (replica/durable.py: lineage and
        step in one number, so that torchft heals the groups of an older lineage from a newer one)."""
        return int(self.manager.current_step())

    def set_position(self, position: int) -> None:
        """Set torchft's step counter (a lineage claimed or restored: the position jumps)."""
        self.manager.load_state_dict(
            {"step": position, "batches_committed": self.manager.batches_committed()}
        )

    def refuse_step(self, reason: str) -> None:
        """Make this step's commit vote say no (torchft records the error; the next quorum starts over)."""
        self.manager.report_error(RuntimeError(reason))

    def errored(self) -> str | None:
        error = self.manager.errored()
        return (
            None
            if error is None
            else f"{type(error.original_exception).__name__}: {error.original_exception}"
        )

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def safe_transport(server: Any, fetch: Callable[[str, int, float], dict[str, Any]]) -> Any:
    """A torchft CheckpointTransport that sends the product's payload through `server` (a HealServer:
    offer / withdraw / address) and receives it with `fetch(url, step, timeout_s)`, which checks it and
    loads it with weights_only=True: never torchft's own pickling transport."""
    from torchft.checkpointing.transport import CheckpointTransport

    class SafeTransport(CheckpointTransport[dict[str, Any]]):
        def metadata(self) -> str:
            return str(server.address())

        def send_checkpoint(
            self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta
        ) -> None:
            server.offer(step, state_dict)

        def disallow_checkpoint(self) -> None:
            server.withdraw()

        def recv_checkpoint(
            self, src_rank: int, metadata: str, step: int, timeout: timedelta
        ) -> dict[str, Any]:
            return fetch(metadata, step, timeout.total_seconds())

        def shutdown(self, wait: bool = True) -> None:
            server.close()

    return SafeTransport()
