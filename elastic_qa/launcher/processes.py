"""The processes of a job on this host: which are alive, whose children they are, and the environment in
which a child Python process imports this same elastic_qa."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import elastic_qa


def alive(pid: int) -> bool:
    """A running process; a killed one that its parent has not reaped yet (a zombie) is not alive."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def children(pid: int) -> list[int]:
    """Direct child processes of `pid`, zombies left out (read from /proc, no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return sorted(found)


def python_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the directory this elastic_qa was imported from
    first on PYTHONPATH: a child `python -m elastic_qa...` then runs the same code as its parent, from a
    checkout's tree or from the installed package, whatever its working directory."""
    env = dict(os.environ if base is None else base)
    home = str(Path(elastic_qa.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (home, env.get("PYTHONPATH")) if p)
    return env
