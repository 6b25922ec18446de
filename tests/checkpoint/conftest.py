"""Checkpoint test fixtures: clean in-memory stores (memory://, faulty://), stores to test on, log capture."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
from fsspec.implementations.memory import MemoryFileSystem
from structlog.testing import capture_logs

from elastic_qa.checkpoint.backends import open_store
from elastic_qa.checkpoint.store import CheckpointStore
from tests.checkpoint.faulty_fs import FaultyFileSystem, faults

_names = itertools.count()


@pytest.fixture(autouse=True)
def clean_memory_stores() -> Iterator[None]:
    """memory:// and faulty:// are process-global: every test starts and ends with them empty."""
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    FaultyFileSystem.clear()
    faults.reset()
    yield
    faults.reset()
    FaultyFileSystem.clear()
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path) -> CheckpointStore:
    """A checkpoint store on local disk (atomic rename) and on memory:// (no rename)."""
    if request.param == "local":
        return open_store(str(tmp_path / "ckpt"))
    return open_store(f"memory://ckpt-{next(_names)}")


@pytest.fixture
def faulty_store() -> CheckpointStore:
    return open_store(f"faulty://ckpt-{next(_names)}")


@pytest.fixture
def events() -> Iterator[list[dict[str, Any]]]:
    """Structured log events emitted during the test (assert on event names and fields, not wording)."""
    previous = structlog.get_config()
    structlog.reset_defaults()  # whatever level another test configured, capture everything
    try:
        with capture_logs() as captured:
            yield captured
    finally:
        structlog.configure(**previous)
