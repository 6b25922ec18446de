"""What a torchrun agent's forkserver imports once, so that every worker it starts is a fork of it.

The local launcher runs each agent with `--start-method=forkserver --run-path` and names this module as
the forkserver's preload (`python -m elastic_qa.launcher.loopback --preload elastic_qa.launcher.warm_start
torch.distributed.run ...`). The forkserver imports it when the first worker group starts; every worker
after that, the restarts that recover a crash or regroup the job included, is forked from a process that
has already imported torch, torch._dynamo (which the optimizer imports at its first step: ~1 s) and the
trainer: a restarted worker starts with its imports done instead of paying ~2 s of interpreter start and
imports on a core that its peer's restart also wants.

Only imports belong here: module-level work that reads the process (its pid, its environment, the time)
would be done once in the forkserver and inherited by every worker. The worker itself restarts the
start-up clock (elastic_qa.train) and reads its environment when it runs.
"""

from __future__ import annotations

# isort: off
from elastic_qa.observe.startup import structlog_without_rich

structlog_without_rich()  # as a worker does first: the forked workers inherit structlog without rich

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.distributed  # noqa: E402, F401

import elastic_qa.launcher.loopback  # noqa: E402
import elastic_qa.train  # noqa: E402, F401  (imported, not run: its main runs only as __main__)
# isort: on
