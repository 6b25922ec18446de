"""Hostile or broken `model.name_or_path` (issue 21, item 7): one line naming the file or field, exit 2.

Nothing here reaches the network: an unreachable hub is a loopback port nobody listens on, the hub cache
an empty temporary directory.
"""

from __future__ import annotations

import http.server
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from elastic_qa.config import ConfigError
from tests.conftest import REPO

pytest.importorskip("transformers")

from elastic_qa.models import hf
from tests.models.test_hf import config


def _edit_config(**fields) -> Callable[[Path], None]:
    def edit(model: Path) -> None:
        settings = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**settings, **fields}))

    return edit


def _truncate(model: Path) -> None:
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


class _Opens:
    """Unpickled, this would create the file: the load must refuse it before anything runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _pickle_bin(model: Path) -> None:
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": _Opens(model / "EXECUTED")}))


# Checked before any model loads (the launcher's preflight and `elastic-qa prepare` read the tokenizer).
BROKEN = {
    "truncated safetensors": (_truncate, r"model\.safetensors: not a whole safetensors file"),
    "config not json": (
        lambda m: (m / "config.json").write_text("{not json"),
        r"config\.json: not valid JSON \(line 1, column 2",
    ),
    "layers as a word": (_edit_config(num_hidden_layers="two"), r"config\.json: num_hidden_layers='two'"),
    "vocab_size of other weights": (
        _edit_config(vocab_size=2000),
        r"model\.safetensors: bert\.embeddings\.word_embeddings\.weight is \[1000, 32\] here, "
        r"config\.json \(vocab_size=2000\) makes it \[2000, 32\]",
    ),
    "max_position_embeddings of other weights": (
        _edit_config(max_position_embeddings=512),
        r"model\.safetensors: .*position_embeddings\.weight .*\(max_position_embeddings=512\)",
    ),
    "no weights": (
        lambda m: (m / "model.safetensors").unlink(),
        r"has no weights \(model\.safetensors or pytorch_model\.bin\)",
    ),
    "shard outside the directory": (
        lambda m: (
            (m / "model.safetensors").rename(m / "shard.safetensors"),
            (m / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"x": "../../elsewhere.safetensors"}})
            ),
        ),
        r"model\.safetensors\.index\.json: shard '\.\./\.\./elsewhere\.safetensors' is not a file name",
    ),
}


@pytest.fixture
def broken_copy(hf_models, tmp_path) -> Iterator[Callable[[Callable[[Path], None]], Path]]:
    def make(damage: Callable[[Path], None]) -> Path:
        model = Path(shutil.copytree(hf_models["bert"], tmp_path / "model"))
        damage(model)
        return model

    yield make


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_model_directory_is_refused_before_loading_naming_the_file_and_field(broken_copy, case):
    damage, expected = BROKEN[case]
    model = broken_copy(damage)
    with pytest.raises(ConfigError, match=expected) as refused:
        hf.cache_identity(config(model))  # what the preflight and `elastic-qa prepare` call first
    assert "\n" not in str(refused.value)


def test_a_pickled_pytorch_model_bin_is_refused_in_one_line_and_nothing_in_it_runs(broken_copy):
    model = broken_copy(_pickle_bin)
    cfg = config(model)
    for load in (hf.cache_identity, lambda cfg: hf.build_model(cfg, 10)):  # the preflight, the worker
        with pytest.raises(ConfigError, match=r"pytorch_model\.bin: holds more than tensors") as refused:
            load(cfg)
        assert "\n" not in str(refused.value) and "Unsupported operand" in str(refused.value)
    assert not (model / "EXECUTED").exists()


def test_a_pytorch_model_bin_of_plain_tensors_loads(hf_models, broken_copy):
    def as_bin(model: Path) -> None:
        from safetensors.torch import load_file

        torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
        (model / "model.safetensors").unlink()

    model = broken_copy(as_bin)
    loaded, expected = hf.build_model(config(model), 10), hf.build_model(config(hf_models["bert"]), 10)
    assert loaded.state_dict().keys() == expected.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.state_dict().items())


def test_weights_that_lack_layers_the_config_describes_are_refused_not_initialised_at_random(broken_copy):
    model = broken_copy(_edit_config(num_hidden_layers=4))  # the weights hold 2
    with pytest.raises(ConfigError, match=r"the weights lack 32 tensors .*bert\.encoder\.layer\.2\."):
        hf.build_model(config(model), 10)


def test_a_missing_directory_and_a_symlink_loop_are_named_as_local_paths(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    cases = {
        tmp_path / "missing": "no such local directory",
        loop: "a local path, but a symlink loop",
        dangling: f"a symlink to {tmp_path / 'gone'}, which does not exist",
        tmp_path / "loop" / "inside": "a local path, but a symlink loop",
    }
    for path, expected in cases.items():
        with pytest.raises(ConfigError, match=expected) as refused:
            hf.load_tokenizer(str(path))
        assert "Repo id" not in str(refused.value)


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port bound but not listening: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _hub_env(tmp_path: Path, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "HUGGINGFACE_"))}
    return {
        **env,
        "PYTHONPATH": str(REPO),
        "HF_HOME": str(tmp_path / "hf-home"),  # an empty hub cache
        "HF_ENDPOINT": f"http://127.0.0.1:{port}",
        **extra,
    }


def _worker(
    tmp_path: Path, name_or_path: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_qa.train",
            "--config",
            "hf-tiny",
            f"model.name_or_path={name_or_path}",
            f"run.dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.synthetic.train_examples=20",
            "data.synthetic.eval_examples=4",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,  # retries of the hub took minutes before; this bounds a regression, asserts no time
    )


@pytest.mark.parametrize("offline", [False, True], ids=["hub unreachable", "HF_HUB_OFFLINE"])
def test_a_hub_id_without_the_hub_is_one_line_naming_it_a_hub_id_and_hf_hub_offline(
    tmp_path, closed_port, offline
):
    env = _hub_env(tmp_path, closed_port, **({"HF_HUB_OFFLINE": "1"} if offline else {}))
    result = _worker(tmp_path, "some-org/some-model", env)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr and "Retrying" not in result.stderr, lines
    assert "'some-org/some-model' (no such local directory, so a hub id)" in lines[0]
    assert "HF_HUB_OFFLINE" in lines[0] and "does not have it" in lines[0]
    if not offline:
        assert f"127.0.0.1:{closed_port}) is unreachable" in lines[0]


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *_args) -> None:  # the test's output is the worker's
        pass


def test_a_hub_that_answers_but_has_no_such_model_is_one_line_naming_a_hub_id(tmp_path):
    """A loopback web server that answers 404 to everything stands for a hub without the model."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = _worker(tmp_path, "some-org/no-such-model", _hub_env(tmp_path, server.server_address[1]))
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, lines
    assert "'some-org/no-such-model' (no such local directory, so a hub id)" in lines[0]


def test_an_unreachable_hub_reads_a_hub_id_from_the_hub_cache(hf_models, tmp_path, closed_port):
    snapshot = tmp_path / "hf-home" / "hub" / "models--some-org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(hf_models["bert"], snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    probe = (
        "from elastic_qa.models import hf; s = hf.resolve('some-org/tiny'); "
        "print(s.path, s.local_only); print(hf.load_tokenizer('some-org/tiny').is_fast)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_hub_env(tmp_path, closed_port),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [str(snapshot), "True", "True"]


@pytest.mark.parametrize("case", ["truncated safetensors", "pickled bin"])
def test_the_worker_exits_2_with_one_line_on_a_broken_model(broken_copy, tmp_path, case):
    model = broken_copy(_truncate if case == "truncated safetensors" else _pickle_bin)
    result = _worker(tmp_path, str(model))
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, lines
    assert ("model.safetensors" if case == "truncated safetensors" else "pytorch_model.bin") in lines[0]
    assert not (model / "EXECUTED").exists()


def test_elastic_qa_prepare_exits_2_with_one_line_on_a_broken_model_config(broken_copy, tmp_path):
    model = broken_copy(_edit_config(num_hidden_layers="two"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_qa.cli",
            "prepare",
            "--config",
            "hf-tiny",
            f"model.name_or_path={model}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        result.stderr.strip()
        == f"elastic-qa: {model / 'config.json'}: num_hidden_layers='two': must be a whole number >= 0"
    )
