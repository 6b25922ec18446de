"""What the tests of `elastic-qa serve` share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_qa.bench.serve import ServerProcess, start_server
from tests.conftest import REPO


@pytest.fixture(scope="module")
def server(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`elastic-qa serve` on the tiny trained run, with the default flags (batching on), one per test
    module; no traceback on its stderr once its clients are done."""
    process = start_server(str(trained), [], tmp_path_factory.mktemp("serve") / "stderr", cwd=REPO)
    yield process
    assert process.stop() == 0
    assert "Traceback" not in process.stderr_path.read_text()
