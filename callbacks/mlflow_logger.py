"""MLflowLogger: the run's metrics, config and plan in an MLflow run that resumes with it."""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from typing_extensions import override

from .tracker import TrackerLogger, import_tracker

#: MLflow's limit on the params of one ``log_batch`` call.
_PARAMS_PER_BATCH = 100


class MLflowLogger(TrackerLogger):
    """Logs to MLflow what TensorBoard shows, on process 0 only.

    * every value that reaches ``logs`` (``train/...``, ``eval/...``, ``lr``, the
      norms, ``perf/...``) as a metric at its global step, one ``log_batch`` per log
      point;
    * the run config (``trainer.config``) flattened as params (``model.width``);
    * the plan report of the train step as the artifact ``plan.txt`` and, with
      ``strategy="auto"``, the ranking of the layouts as ``layout.md``.

    A resumed run writes into the same MLflow run: its id is in the callback's
    ``state_dict``, saved with every checkpoint. Steps the killed attempt logged after
    its last checkpoint are trained again after the resume; MLflow keeps every value it
    is given, so those steps are not logged a second time: the run keeps the first
    attempt's values (bitwise the same where the resume is exact), each step once, with
    no gap. Params already in the resumed run are not logged again (MLflow refuses a
    changed param value; a changed config shows in the new keys only).

    A tracking server that cannot be reached warns once and training goes on without
    it: one request with a ``connect_timeout_s`` limit asks the server first (MLflow
    itself retries a failed request 7 times with backoff, minutes, before it gives up;
    ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and ``MLFLOW_HTTP_REQUEST_TIMEOUT`` set that
    for a server that answers, then fails).

    Args:
      tracking_uri: a server (``http://host:5000``) or a local store
        (``sqlite:///runs/mlflow.db``); ``None``: MLflow's own default
        (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``).
      experiment: the experiment's name; created if missing.
      run_name: the name of a new run (MLflow makes one up for ``None``).
      artifact_location: where a new experiment keeps its artifacts (MLflow's default
        for ``None``: ``./mlruns`` beside a local store).
      tags: tags of a new run.
      connect_timeout_s: how long an ``http(s)://`` server has to answer the first
        request before the run goes on without it.

    Needs ``pip install nnx-spmd-trainer[mlflow]`` (``mlflow-skinny``, and SQLAlchemy for
    a ``sqlite:///`` store). That client logs, but has no web UI: ``mlflow ui`` (MLflow's
    server, which needs Flask) comes with ``pip install nnx-spmd-trainer[mlflow-ui]`` (the
    full ``mlflow``), in this environment or any other that can read the store.

    A new ``sqlite:///`` store is made by MLflow's schema migrations before its first
    run: about 15 s on a CPU machine here, once per store file, before the first step (the
    CLI says so in a line); an existing store or a tracking server does not pay it.

    Example::

        Trainer(..., config=config, callbacks=[
            MetricsLogger(50), OrbaxCheckpoint("runs/a/ckpt", save_every_n_steps=200),
            MLflowLogger("sqlite:///runs/mlflow.db", experiment="gpt", run_name="a")])
        # pip install 'nnx-spmd-trainer[mlflow-ui]'
        # mlflow ui --backend-store-uri sqlite:///runs/mlflow.db
    """

    tracker = "MLflow"

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment: str = "nnx-spmd-trainer",
        run_name: str | None = None,
        artifact_location: str | None = None,
        tags: dict[str, str] | None = None,
        connect_timeout_s: float = 10.0,
    ) -> None:
        super().__init__()
        import_tracker("mlflow", "mlflow")  # a missing package is known when the run is built
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.artifact_location = artifact_location
        self.tags = dict(tags or {})
        self.connect_timeout_s = connect_timeout_s
        self._client: Any = None

    @property
    def client(self) -> Any:
        """The ``mlflow.MlflowClient`` of ``tracking_uri`` (made on first use)."""
        if self._client is None:
            mlflow = import_tracker("mlflow", "mlflow")
            self._client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    @override
    def _open(self, run_id: str | None) -> str:
        if self.tracking_uri and self.tracking_uri.startswith(("http://", "https://")):
            _check_answers(self.tracking_uri, self.connect_timeout_s)
        client = self.client
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")  # a killed run is left RUNNING
            return run_id
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = (
            found.experiment_id
            if found is not None
            else client.create_experiment(self.experiment, self.artifact_location)
        )
        run = client.create_run(experiment_id, tags=self.tags, run_name=self.run_name)
        return str(run.info.run_id)

    @override
    def _logged_steps(self) -> dict[str, int]:
        assert self.run_id is not None
        keys = self.client.get_run(self.run_id).data.metrics
        return {
            key: max(m.step for m in self.client.get_metric_history(self.run_id, key))
            for key in keys
        }

    @override
    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        assert self.run_id is not None
        present = self.client.get_run(self.run_id).data.params
        new = [Param(key, str(value)) for key, value in params.items() if key not in present]
        for start in range(0, len(new), _PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[start : start + _PARAMS_PER_BATCH])

    @override
    def _log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        assert self.run_id is not None
        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    @override
    def _log_text(self, name: str, text: str) -> None:
        assert self.run_id is not None
        self.client.log_text(self.run_id, text, name)

    @override
    def _close(self, failed: bool) -> None:
        assert self.run_id is not None
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _check_answers(uri: str, timeout_s: float) -> None:
    """Raises ``ConnectionError`` unless something answers an HTTP request at ``uri``
    within ``timeout_s``: any status (a server behind a proxy may refuse ``/``), or a TLS
    handshake this probe cannot verify (MLflow may, with its own certificates). The
    URI's credentials are left out of the probe (urllib would read them as the host)."""
    parts = urllib.parse.urlsplit(uri)
    bare = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    try:
        urllib.request.urlopen(bare, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError) as error:  # URLError, refused, timed out, a bad URI
        reason = getattr(error, "reason", error)
        if isinstance(reason, ssl.SSLError):
            return  # a TLS server answered
        raise ConnectionError(
            f"no MLflow server answers at {bare} within {timeout_s:g} s ({reason}); start "
            "it (mlflow server ...) or give a reachable tracking_uri / --config.mlflow_uri"
        ) from error
