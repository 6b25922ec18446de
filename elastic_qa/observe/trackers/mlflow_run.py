"""The run's MLflow run (`log.trackers: [mlflow]`, extra `elastic-qa[mlflow]`): found again by its tag.

The first start creates the run tagged `elastic_qa.run=<run uuid>` in one call (a crash cannot leave an
untagged run behind), then logs the resolved config as its params; every later start searches the
experiment for that tag and continues the run it finds, logging the params a start killed before it had
logged them all left out (those it holds stay as they are: MLflow's params cannot change). Its high-water
mark per metric is the highest step of the metric's history, read back from the tracking store.
"""

from __future__ import annotations

import time
from typing import Any

from elastic_qa.config import Config
from elastic_qa.observe.trackers.background import Record, tracker_run_name

RUN_TAG = "elastic_qa.run"
# MLflow's limits: metrics and params per log_batch call, characters of a param's value.
_METRICS_PER_CALL = 1000
_PARAMS_PER_CALL = 100
_PARAM_CHARS = 6000


class MlflowRun:
    name = "mlflow"
    pending_records = 0  # log_batch returns once the store has the metrics

    def __init__(self, cfg: Config, run_uuid: str) -> None:

        self.settings = cfg.log.mlflow
        self.run_uuid = run_uuid
        self.run_name = tracker_run_name(cfg)
        self.params = flat_params(cfg.to_dict())
        self.client: Any = None
        self.run_id = ""

    def open(self) -> dict[str, int]:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.settings.tracking_uri or None)
        experiment = self._experiment_id()
        found = self.client.search_runs(
            [experiment], filter_string=f"tags.`{RUN_TAG}` = '{self.run_uuid}'", max_results=1
        )
        if not found:
            run = self.client.create_run(experiment, run_name=self.run_name, tags={RUN_TAG: self.run_uuid})
            self.run_id = run.info.run_id
            self._log_params(set())
            return {}
        self.run_id = found[0].info.run_id
        self.client.update_run(self.run_id, status="RUNNING")
        self._log_params(set(found[0].data.params))
        return {
            key: max(metric.step for metric in self.client.get_metric_history(self.run_id, key))
            for key in found[0].data.metrics
        }

    def log(self, records: list[Record]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [
            Metric(key, value, now_ms, step) for step, values in records for key, value in values.items()
        ]
        for start in range(0, len(metrics), _METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + _METRICS_PER_CALL])

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self.settings.experiment
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except MlflowException:  # another run created it meanwhile
            return str(self.client.get_experiment_by_name(name).experiment_id)

    def _log_params(self, held: set[str]) -> None:
        """The config's params the run does not hold yet (`held`: those it does)."""
        from mlflow.entities import Param

        params = [Param(key, value) for key, value in self.params.items() if key not in held]
        for start in range(0, len(params), _PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start : start + _PARAMS_PER_CALL])


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: `train.max_steps` -> "40" (values cut to MLflow's length limit)."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)[:_PARAM_CHARS]
    return flat
