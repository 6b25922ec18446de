"""The run's W&B run (`log.trackers: [wandb]`, extra `elastic-qa[wandb]`): its id is the run's uuid.

Every start calls wandb.init with that id and resume="allow": the first creates the run, later ones continue
it. The high-water mark: online, W&B's resumed `run.step` (W&B itself ignores a step below it); offline,
where W&B knows nothing of earlier attempts, the steps in the earlier offline files of this run id under
the wandb folder (each attempt writes one `offline-run-<time>-<id>`; `wandb sync` uploads them in order).
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elastic_qa.config import Config, ConfigError
from elastic_qa.observe.log import get_logger
from elastic_qa.observe.trackers.background import QUEUE_CALLS, Record, tracker_run_name


class WandbRun:
    name = "wandb"
    # wandb.log hands a row to W&B's own process, which writes it (offline) or sends it (online) a moment
    # later; a row is taken as held once this many newer ones followed it, or once the run is finished.
    pending_records = QUEUE_CALLS

    def __init__(self, cfg: Config, run_uuid: str) -> None:

        self.settings = cfg.log.wandb
        self.run_uuid = run_uuid
        self.run_name = tracker_run_name(cfg)
        self.config = cfg.to_dict()
        self.dir, self.dir_setting = wandb_dir(cfg)
        self.run: Any = None

    def open(self) -> dict[str, int]:
        import wandb

        offline = self.settings.mode == "offline"
        earlier = offline_high_water(Path(self.dir) / "wandb", self.run_uuid) if offline else {}
        check_dir(self.dir, self.dir_setting)  # it may have changed since the start, or on this host
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.settings.project,
            entity=self.settings.entity or None,
            id=self.run_uuid,
            name=self.run_name,
            resume="allow",
            mode=self.settings.mode,
            dir=self.dir,
            config=self.config,
            settings=wandb.Settings(console="off", silent=True),
        )
        if offline or not self.run.resumed:
            return earlier
        return {key: self.run.step - 1 for key in self.run.summary if not key.startswith("_")}

    def log(self, records: list[Record]) -> None:
        for step, values in records:
            self.run.log(values, step=step)

    def close(self, finished: bool) -> None:
        import wandb

        self.run.finish(exit_code=0 if finished else 1)
        wandb.teardown()  # waits for W&B's own process to have written (offline) or sent everything


def wandb_dir(cfg: Config) -> tuple[str, str]:
    """The folder W&B writes in, and the setting that chose it (for messages)."""
    if cfg.log.wandb.dir:
        return cfg.log.wandb.dir, "log.wandb.dir"
    if os.environ.get("WANDB_DIR"):
        return os.environ["WANDB_DIR"], "WANDB_DIR"
    return cfg.run.dir, "log.wandb.dir is empty, so run.dir"


def check_dir(path: str, setting: str) -> None:
    """ConfigError naming `setting` unless W&B can create and write the folder `path` and its `wandb`
    folder. Where it cannot create or write `path`, W&B writes the run to the system's temporary directory
    instead, which every local user shares, and says so only on a console nobody may read: never let it."""
    folder = Path(path).absolute()
    existing = next(p for p in (folder, *folder.parents) if os.path.lexists(p))
    # W&B's own test (os.access), on the folder or the nearest level that exists, where it would create it.
    for level in (existing, folder / "wandb") if existing == folder else (existing,):
        if not os.path.lexists(level):
            continue
        if not level.is_dir():
            why = f"{level} is not a directory"
        elif not os.access(level, os.R_OK | os.W_OK | os.X_OK):
            why = f"{level} is not writable by this user"
        else:
            continue
        raise ConfigError(
            f"{setting}={path}: W&B cannot write there ({why}); it would write the run to "
            f"{tempfile.gettempdir()}, which other users can read: name a folder this user can write"
        )


def offline_high_water(wandb_dir: Path, run_id: str) -> dict[str, int]:
    """The highest step per metric in the offline files of run `run_id` under `wandb_dir` ({} if none).
    A file that cannot be read is skipped with a warning: its steps may then be logged again."""
    high: dict[str, int] = {}
    for path in sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        try:
            for step, keys in offline_history(path):
                high.update({key: max(step, high.get(key, 0)) for key in keys})
        except (OSError, ValueError) as err:
            get_logger().warning("tracker_history_unread", tracker="wandb", path=str(path), error=str(err))
    return high


# The .wandb file: ":W&B", a 2-byte magic and a version byte, then a LevelDB-style log of 32 KiB blocks,
# each record a 7-byte header (crc32, length, type: full, first, middle, last) and a protobuf `Record`.
_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def offline_history(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(step, metric names) of each history row of a W&B offline run file; ValueError when it is not one."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    for chunk in _log_records(path.read_bytes()):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated per protobuf version
        try:
            record.ParseFromString(chunk)
        except DecodeError as err:
            raise ValueError(f"a record that is not a W&B Record ({err})") from None
        if record.WhichOneof("record_type") == "history":
            keys = [item.key or "/".join(item.nested_key) for item in record.history.item]
            yield record.history.step.num, [key for key in keys if not key.startswith("_")]


def _log_records(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (no :W&B header)")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0:  # zeros to the block's end
            pos += left
            continue
        body = data[pos + _HEADER : pos + _HEADER + length]
        if len(body) < length:  # the last record of a writer killed mid-write
            return
        pos += _HEADER + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            yield pending + body
