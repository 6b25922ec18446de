"""elastic_qa: an elastic, fault-tolerant data-parallel trainer for extractive question answering.

The Python API (`fit`, `predict`, `evaluate`: elastic_qa/api.py) is imported on first use, so that
`import elastic_qa` stays cheap (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from elastic_qa.api import Answer, FitInProgress, FitResult, TrainingFailed, evaluate, fit, predict

__all__ = ["Answer", "FitInProgress", "FitResult", "TrainingFailed", "evaluate", "fit", "predict"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from elastic_qa import api

        return getattr(api, name)
    raise AttributeError(f"module 'elastic_qa' has no attribute {name!r}")
