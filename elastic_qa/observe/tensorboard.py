"""Optional TensorBoard scalars (`log.tensorboard=true`, extra `elastic-qa[tensorboard]`).

Each rank writes to `<run.dir>/tensorboard/rank-<r>` under the same tags, so TensorBoard draws all ranks on
one chart per tag: a straggler or a rank with an odd loss stands out.
"""

from __future__ import annotations

from pathlib import Path

from elastic_qa.config import ConfigError


class TensorBoardScalars:
    def __init__(self, run_dir: str, rank: int) -> None:
        self.check_installed()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard" / f"rank-{rank}"))

    @staticmethod
    def check_installed() -> None:
        try:
            import tensorboard  # noqa: F401 - only whether it imports
        except ImportError:
            raise ConfigError(
                "log.tensorboard=true needs the tensorboard package: pip install 'elastic-qa[tensorboard]'"
            ) from None

    def add(self, step: int, **scalars: float) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()
