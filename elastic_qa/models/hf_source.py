"""Where an `hf` model is read from, checked before anything loads it: one line naming what is wrong.

`model.name_or_path` is a local directory when such a path exists (or it cannot be a hub id: an absolute
or relative path, `~`, more than one `/`); anything else is a hub id. A local directory, or the hub cache's
copy of a hub id, is checked file by file: the JSON files parse, config.json's sizes are whole numbers and
transformers accepts it, the weights are there, safetensors headers are whole and match the shapes
config.json gives, a pytorch_model.bin unpickles with weights_only=True (memory-mapped). A hub id is first
asked for with a short probe of the hub: offline (HF_HUB_OFFLINE) or unreachable, only the hub cache is
read, and a model that is not there is one line, not minutes of retries. Nothing in the directory is
executed: the configs are data, safetensors headers are JSON, pickles are read with weights_only=True.

Runs in the launcher's preflight (through the feature cache's key, which reads the tokenizer), in
`elastic-qa prepare`, and again in every worker, so that bad input is exit 2 before any agent starts.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import pickle
import re
import stat
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_qa.config import ConfigError

# The hub must answer a HEAD request within this long, else the hub id is read from the hub cache only.
HUB_PROBE_S = 10.0
# Files transformers reads as JSON; a broken one is named here rather than deep inside transformers.
JSON_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
# config.json fields that size the model: a string or a fraction here fails deep inside the model.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
)


@dataclass(frozen=True)
class Source:
    """What `from_pretrained` is given: a directory (local, or the hub cache's copy) or a hub id."""

    path: str
    local_only: bool  # local_files_only: never ask the hub
    where: str  # model.name_or_path and what it was taken for, to start every error line


def one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (some span several: "Validation error for field ...:\\n ...")."""
    text = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return (text or type(err).__name__)[:limit]


@functools.lru_cache(maxsize=8)
def resolve(name_or_path: str) -> Source:
    """The checked source of `model.name_or_path`; ConfigError naming the file or field that is wrong."""
    given = f"model.name_or_path={name_or_path!r}"
    path = Path(name_or_path).expanduser()
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(f"{given}: a local path, but a symlink loop ({path})") from None
        if err.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise ConfigError(f"{given}: a local path that cannot be read ({err.strerror})") from None
        if os.path.islink(path):
            raise ConfigError(
                f"{given}: a local path, a symlink to {os.readlink(path)}, which does not exist"
            ) from None
        if not _can_be_hub_id(name_or_path):
            raise ConfigError(
                f"{given}: no such local directory (and not a hub id, 'name' or 'org/name')"
            ) from None
        return _hub_source(name_or_path, f"{given} (no such local directory, so a hub id)")
    if not stat.S_ISDIR(mode):
        raise ConfigError(f"{given}: a local path, but a file, not a model directory (save_pretrained's)")
    where = f"{given} (a local directory)"
    check_directory(path, where)
    return Source(str(path), True, where)


def _can_be_hub_id(text: str) -> bool:
    if text.startswith(("/", ".", "~")):
        return False
    try:
        from huggingface_hub.utils import validate_repo_id
    except ImportError:  # some other layout of huggingface_hub: 'name' or 'org/name' is all we assume
        return text.count("/") <= 1
    try:
        validate_repo_id(text)
    except ValueError:
        return False
    return True


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it, also when set after import."""
    from huggingface_hub import constants

    truthy = {"1", "on", "yes", "true"}
    env = {os.environ.get(name, "").strip().lower() for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return bool(constants.HF_HUB_OFFLINE) or bool(env & truthy)


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached now (one bounded request, no retries), or None when it answers."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_S)
    except Exception as err:  # noqa: BLE001 - no answer (refused, DNS, timeout, proxy): unreachable
        # requests and httpx wrap the socket's error several times over: its "[Errno N] ..." says it all.
        text = one_line(err, 1000)
        found = re.search(r"\[Errno -?\d+\] [^'\"()\]]+", text)
        reason = found.group(0).strip() if found else text[:120]
        return f"the hub ({constants.ENDPOINT}) is unreachable ({reason})"
    return None  # any answer, even an error status, means the hub is there


def _cached_snapshot(repo_id: str) -> Path | None:
    """The hub cache's copy of `repo_id` (its newest snapshot of `main`), if it has config.json."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def _hub_source(repo_id: str, where: str) -> Source:
    from huggingface_hub import constants

    problem = "HF_HUB_OFFLINE is set" if hub_offline() else _hub_unreachable()
    if problem is None:
        return Source(repo_id, False, where)  # transformers downloads it, or uses its cached copy
    cached = _cached_snapshot(repo_id)
    if cached is None:
        advice = (
            "unset HF_HUB_OFFLINE to download it, or give a local directory"
            if problem.startswith("HF_HUB_OFFLINE")
            else "download it where the hub is reachable, or give a local directory; "
            "HF_HUB_OFFLINE=1 skips the hub"
        )
        raise ConfigError(
            f"{where}: {problem} and the hub cache ({constants.HF_HUB_CACHE}) does not have it: {advice}"
        )
    where = f"{where}, read from the hub cache ({problem})"
    check_directory(cached, where)
    return Source(str(cached), True, where)


def check_directory(path: Path, where: str) -> None:
    """A model directory's files, checked without executing anything; tensors' bytes are not read (a
    legacy, non-zip pytorch_model.bin excepted: it cannot be memory-mapped)."""
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where}: {path} has no config.json (not a directory save_pretrained wrote)")
    parsed = {name: _json(path / name) for name in JSON_FILES if (path / name).is_file()}
    config_json = parsed["config.json"]
    if not isinstance(config_json, dict):
        raise ConfigError(f"{path / 'config.json'}: not a JSON object")
    for name in SIZE_FIELDS:
        value = config_json.get(name)
        if value is not None and (type(value) is not int or value < 0):  # null: transformers decides
            raise ConfigError(f"{path / 'config.json'}: {name}={value!r}: must be a whole number >= 0")
    config = _auto_config(path)
    weights = _safetensors_files(path, parsed)
    if weights:
        expected = _expected_shapes(config)
        for file in weights:
            _check_safetensors(file, expected, config_json)
        return
    pickled = _shards(path, "pytorch_model.bin", parsed)
    if not pickled:
        raise ConfigError(f"{where}: {path} has no weights (model.safetensors or pytorch_model.bin)")
    for file in pickled:
        _check_pickled(file)


def _json(file: Path) -> Any:
    try:
        return json.loads(file.read_bytes())
    except json.JSONDecodeError as err:
        where = f"line {err.lineno}, column {err.colno}"
        raise ConfigError(f"{file}: not valid JSON ({where}: {err.msg})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{file}: cannot be read ({one_line(err, 120)})") from None


def _auto_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - its own checks: unknown model_type, types, values
        raise ConfigError(f"{path / 'config.json'}: {one_line(err)}") from None


def _safetensors_files(path: Path, parsed: dict[str, Any]) -> list[Path]:
    """The safetensors files transformers would load (it prefers them to pytorch_model.bin)."""
    return _shards(path, "model.safetensors", parsed)


def _shards(path: Path, name: str, parsed: dict[str, Any]) -> list[Path]:
    """The weight file `name`, or the shards its index lists (each checked to lie in the directory)."""
    if (path / name).is_file():
        return [path / name]
    index = parsed.get(f"{name}.index.json")
    if index is None:
        return []
    where = path / f"{name}.index.json"
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{where}: has no weight_map")
    shards = sorted({str(name) for name in weight_map.values()})
    for name in shards:
        if Path(name).name != name:  # a shard must lie in the directory itself
            raise ConfigError(f"{where}: shard {name!r} is not a file name in this directory")
        if not (path / name).is_file():
            raise ConfigError(f"{where}: shard {name} is missing")
    return [path / name for name in shards]


def _expected_shapes(config: Any) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The QA model's base prefix and parameter shapes as config.json describes them (built on the meta
    device: no memory, no initialisation); empty when the architecture cannot be built there."""
    from transformers import AutoModelForQuestionAnswering

    try:
        with torch.device("meta"):
            model = AutoModelForQuestionAnswering.from_config(config, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - the worker's full load still compares every shape
        return "", {}
    return model.base_model_prefix, {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _check_safetensors(
    file: Path, expected: tuple[str, dict[str, tuple[int, ...]]], config_json: dict[str, Any]
) -> None:
    """The header parses and covers the whole file, and each tensor has the shape config.json gives."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as tensors:
            shapes = {key: tuple(tensors.get_slice(key).get_shape()) for key in tensors.keys()}  # noqa: SIM118
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - the Rust side raises a plain SafetensorError
        raise ConfigError(f"{file}: not a whole safetensors file ({one_line(err, 200)})") from None
    prefix, model_shapes = expected
    for key, shape in shapes.items():
        # Saved from the base model (no prefix) or from a model with a head (prefixed): both load.
        name = next((k for k in (key, f"{prefix}.{key}") if k in model_shapes), None)
        if name is not None and model_shapes[name] != shape:
            raise ConfigError(f"{file}: {mismatch(key, shape, model_shapes[name], config_json)}")


def _check_pickled(file: Path) -> None:
    """A pytorch_model.bin unpickles with weights_only=True (tensors and plain containers, nothing run);
    a zip-format file is memory-mapped, so the tensors' bytes are not read here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols: the refusal says enough
            torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except MemoryError:
        raise
    except pickle.UnpicklingError as err:
        raise ConfigError(f"{file}: {refused_pickle(err)}") from None
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError and others for a damaged file
        raise ConfigError(f"{file}: not a readable torch file ({one_line(err, 200)})") from None


def refused_pickle(err: BaseException) -> str:
    """What weights_only refused, on one line: torch's message is a page of advice around it."""
    text = one_line(err, 2000)
    detail = text.partition("WeightsUnpickler error:")[2] or text
    detail = detail.split(" Please use", 1)[0].split(" Check the documentation", 1)[0].strip()
    return f"holds more than tensors, refused by weights_only=True ({detail[:200]})"


def mismatch(key: str, stored: tuple[int, ...], described: tuple[int, ...], config_json: dict) -> str:
    """ "<key> is [1000, 32] here, config.json (vocab_size=2000) makes it [2000, 32]"."""
    fields = [
        f"{name}={value}"
        for name, value in config_json.items()
        if type(value) is int and value in described and value not in stored and value > 1
    ]
    said = f"config.json ({', '.join(fields)})" if fields else "config.json"
    return f"{key} is {list(stored)} here, {said} makes it {list(described)}: the config does not fit"
