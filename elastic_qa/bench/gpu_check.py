"""`make gpu-check`, or `python -m elastic_qa.bench.gpu_check [options]`: the gpu benchmark on a bare machine.

It first checks that the packages the trainer imports are installed (a GPU machine without network
cannot fetch them: each missing one is named, exit 2), then runs `elastic-qa bench gpu` (bench/gpu.py;
`--help` for its options). With $OUT set (a directory whose files come back from a remote machine) the
figures go to $OUT/gpu-check.json and the runs' logs, without checkpoints or caches, to
$OUT/gpu-check-logs.tar.gz.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

# Modules the trainer imports -> the package that provides them. Only the standard library is imported
# before they are checked.
REQUIRED = {
    "torch": "torch",
    "numpy": "numpy",
    "yaml": "pyyaml",
    "structlog": "structlog",
    "torchdata": "torchdata",
    "fsspec": "fsspec",
    "safetensors": "safetensors",
}
# Large or rebuildable: left out of the logs archive.
NOT_ARCHIVED = {"checkpoints", "cache", "hf-bert", "rejected"}


def missing_packages() -> list[str]:
    return [package for module, package in REQUIRED.items() if importlib.util.find_spec(module) is None]


def archive_logs(work: Path, target: Path) -> None:
    """Everything under `work` but checkpoints, caches and the generated model, as one .tar.gz."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if NOT_ARCHIVED & set(Path(info.name).parts) else info

    with tarfile.open(target, "w:gz") as archive:
        archive.add(work, arcname="gpu-check", filter=keep)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    absent = missing_packages()
    if "torch" in absent:
        print(
            f"gpu-check: {sys.executable} cannot import torch: run this with the Python that has the CUDA "
            "build of torch (make gpu-check GPU_PYTHON=/path/to/python)",
            file=sys.stderr,
        )
        return 2
    if absent:
        print(
            f"gpu-check: missing Python packages: {', '.join(absent)}. Install them into the Python that "
            f"has the CUDA build of torch (pip install {' '.join(absent)}); on a machine without network, "
            "bring their wheels and install those with pip install --no-index",
            file=sys.stderr,
        )
        return 2
    out = os.environ.get("OUT")
    work = None
    if out:
        if "--json" not in argv:
            argv += ["--json", str(Path(out) / "gpu-check.json")]
        if "--work-dir" not in argv:
            work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
            argv += ["--work-dir", str(work)]
    from elastic_qa.bench import cli  # imports the packages checked above

    try:
        return cli.main(["gpu", *argv])
    finally:
        if work is not None and out:
            archive_logs(work, Path(out) / "gpu-check-logs.tar.gz")
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
