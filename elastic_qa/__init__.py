"""elastic_qa: an elastic, fault-tolerant data-parallel trainer for extractive question answering.

The Python API (`fit`, `predict`, `evaluate`: elastic_qa/api.py) is imported on first use, so that
`import elastic_qa` stays cheap (no torch).
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from elastic_qa.api import Answer, FitResult, TrainingFailed, evaluate, fit, predict

__all__ = ["Answer", "FitResult", "TrainingFailed", "evaluate", "fit", "predict"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from elastic_qa import api

        return getattr(api, name)
    raise AttributeError(f"module 'elastic_qa' has no attribute {name!r}")


class _Package(types.ModuleType):
    """`elastic_qa.evaluate` is the API's function: importing the submodule of that name (evaluate.py,
    which `from elastic_qa.evaluate import ...` still reaches) must not set the module over it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
