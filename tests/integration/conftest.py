"""The fault-free reference run, shared by every integration module that compares against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_elastic import MAX_STEPS, checked_final_parameters, finish, run_job


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict:
    """A fault-free run at world size 2: the parameters every faulted run must reproduce. Session-scoped
    here, not module-scoped in test_elastic.py: test_node_local.py took its own copy of that fixture, which
    ran the same job a second time in every process that ran both modules."""
    run_dir = tmp_path_factory.mktemp("reference")
    job = run_job(run_dir, cache_dir)
    assert finish(job) == 0
    return checked_final_parameters(run_dir, MAX_STEPS)
