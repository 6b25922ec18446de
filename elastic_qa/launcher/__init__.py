"""torchrun agents: the local launcher (all agents on this host) and the per-host command of a multi-node job.

    python -m elastic_qa.launcher.local start|join|leave|stop|status ...   (launch/local.sh in a checkout)
    elastic-qa node --endpoint HOST0:29400 ...                             (launch/node.sh in a checkout)

local.py is the local command; node.py the per-host one, with netplan.py deciding and checking its network
settings; rendezvous.py holds the rendezvous settings and their trade-offs; loopback.py runs torchrun and
every worker with the TCP stores they host bound to loopback; processes.py finds the job's processes;
warm_start.py is what each agent's forkserver imports so that its workers start warm. The core packages
never import this one.
"""

from pathlib import Path

# Runs a module (torchrun itself, then each worker) with the TCP stores it hosts bound to loopback.
ON_LOOPBACK = "elastic_qa.launcher.loopback"
LOOPBACK_FILE = Path(__file__).with_name("loopback.py")  # ON_LOOPBACK, run as a file by a forked worker
PRELOAD_FLAG = "--preload="  # loopback.py's first argument in an agent whose workers are forkserver forks
