"""The scheduler recipes under launch/: the shell scripts are valid (shellcheck where installed), the SLURM
script turns a time-limit SIGTERM into a save on every node and a requeue, and the Kubernetes manifest
parses and runs `elastic-qa node` with the store host on pod 0.

No SLURM or Kubernetes cluster runs here: srun, scontrol and elastic-qa are stand-ins on PATH that
record what they were asked (unit tests of the scripts' own logic)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

LAUNCH = REPO / "launch"
SCRIPTS = sorted([*LAUNCH.glob("*.sh"), LAUNCH / "slurm.sbatch"])

# Stand-in for `elastic-qa`: records its arguments and pid, then waits for SIGTERM and exits 143, as the
# real one does once its workers have saved.
FAKE_ELASTIC_QA = """#!/usr/bin/env bash
echo "$SLURM_NODEID $*" >> "$RECORD/args"
trap 'echo "$SLURM_NODEID TERM" >> "$RECORD/signals"; exit 143' TERM
echo $$ >> "$RECORD/pids"
while true; do sleep 0.05; done
"""
# Stand-in for srun: one task per node of the allocation, each with its SLURM_NODEID; exits with the
# highest exit code of its tasks, as srun does.
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((id = 0; id < SLURM_JOB_NUM_NODES; id++)); do SLURM_NODEID=$id "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || { code=$?; [ $code -gt $status ] && status=$code; }; done
exit $status
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "$*" >> "$RECORD/scontrol"
"""


def test_every_launch_script_is_valid_bash() -> None:
    for script in SCRIPTS:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, (script, result.stderr)


def test_every_launch_script_passes_shellcheck() -> None:
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (Debian: apt-get install shellcheck)")
    result = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("elastic-qa", FAKE_ELASTIC_QA), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "record").mkdir()
    return bin_dir


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_slurm_time_limit_sigterm_to_every_task_saves_then_requeues_the_same_run(tmp_path: Path) -> None:
    directives = [
        line for line in (LAUNCH / "slurm.sbatch").read_text().splitlines() if line.startswith("#SBATCH")
    ]
    assert "#SBATCH --requeue" in directives
    # To the tasks, not the batch shell (B:): srun takes a SIGTERM as an order to kill its step at once.
    assert any(line.startswith("#SBATCH --signal=TERM@") for line in directives)
    bin_dir, record = fake_bin(tmp_path), tmp_path / "record"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RECORD": str(record),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "eqa",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_RESTART_COUNT": "1",
        "ENDPOINT_ADDR": "10.0.0.1",
        "RUN_DIR": str(tmp_path / "run"),
    }
    script = subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch"), "train.max_steps=9"], env=env)
    deadline = time.monotonic() + 30
    while len(lines(record / "pids")) < 2:
        assert time.monotonic() < deadline and script.poll() is None
        time.sleep(0.05)
    for pid in lines(record / "pids"):  # what --signal=TERM@120 does before the time limit
        os.kill(int(pid), signal.SIGTERM)
    assert script.wait(timeout=30) == 0
    assert sorted(lines(record / "signals")) == ["0 TERM", "1 TERM"]
    assert lines(record / "scontrol") == ["requeue 4242"]
    args = dict(line.split(" ", 1) for line in lines(record / "args"))
    for node_id, text in args.items():
        assert text.startswith("node --endpoint 10.0.0.1:29400 --nnodes 1:2")
        assert "--rdzv-id 4242-1" in text and f"run.dir={tmp_path / 'run'}" in text
        assert text.endswith("train.max_steps=9")
        assert ("--store-host" in text) == (node_id == "0")


def test_kubernetes_manifest_is_an_indexed_job_with_the_store_host_on_pod_0(tmp_path: Path) -> None:
    documents = list(yaml.safe_load_all((LAUNCH / "k8s" / "elastic-qa.yaml").read_text()))
    service = next(d for d in documents if d["kind"] == "Service")
    job = next(d for d in documents if d["kind"] == "Job")
    assert service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert pod["terminationGracePeriodSeconds"] > 30  # torchrun waits 30 s for the workers to save
    rules = spec["podFailurePolicy"]["rules"]
    assert {"type": "DisruptionTarget"} in rules[0]["onPodConditions"] and rules[0]["action"] == "Ignore"
    (container,) = pod["containers"]
    bin_dir, record = fake_bin(tmp_path), tmp_path / "record"
    (bin_dir / "elastic-qa").write_text(
        '#!/usr/bin/env bash\necho "$JOB_COMPLETION_INDEX $*" >> "$RECORD/args"\n'
    )
    for index in ("0", "1"):
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), "JOB_COMPLETION_INDEX": index}
        subprocess.run([*container["command"], *container["args"]], env=env, check=True, timeout=10)
    args = dict(line.split(" ", 1) for line in lines(record / "args"))
    assert args["0"].startswith("node --endpoint elastic-qa-0.elastic-qa:29400")
    assert "--store-host" in args["0"] and "--store-host" not in args["1"]
