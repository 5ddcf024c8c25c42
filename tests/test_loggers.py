"""The Lightning callbacks with loggers other than TensorBoard, read back from what reached them.

One fit logs to a CSVLogger, an offline WandbLogger and an MLFlowLogger (a sqlite store in
the test's folder) at once; each must hold the numbers the monitors kept in their history,
at the same steps, and the ladder pictures where the logger takes images.  Nothing reaches a
network: W&B runs offline, MLflow writes a local file.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
from conftest import gpt, loader

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor
from lnmonitor.views.events import read_csv_scalars

STEPS, EVERY = 4, 2


@pytest.fixture
def fitted(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    loggers = {
        "csv": CSVLogger(tmp_path / "csv"),
        "wandb": WandbLogger(offline=True, save_dir=str(tmp_path), project="lnmonitor-test"),
        "mlflow": MLFlowLogger(experiment_name="lnmonitor-test", tracking_uri=f"sqlite:///{tmp_path}/ml.db",
                               artifact_location=str(tmp_path / "artifacts")),
    }
    monitors = [LayerNormMonitor(every_n_steps=EVERY, keep_history=True, summary=False),
                FinalNormInvarianceMonitor(invariance_every_n_steps=EVERY, probe_size=4, keep_history=True,
                                           summary=False)]
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", logger=list(loggers.values()), callbacks=monitors,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(gpt(STEPS), loader(32, 4))
    summary = dict(loggers["wandb"].experiment.summary)
    media = tmp_path / "wandb"
    wandb.finish()
    return monitors, loggers, summary, media


def _logged(monitors) -> dict[str, dict[int, float]]:
    curves: dict[str, dict[int, float]] = {}
    for m in monitors:
        for row in m.history:
            for tag, value in row.items():
                if tag != "step":
                    curves.setdefault(tag, {})[row["step"]] = value
    return curves


def test_what_the_monitors_log_reaches_csv_wandb_and_mlflow_alike(fitted):
    from mlflow.tracking import MlflowClient

    monitors, loggers, wandb_summary, media = fitted
    assert all(m.off_reason is None for m in monitors)
    logged = _logged(monitors)
    assert {0, 2, 3} <= set(logged["lnmonitor/ladder/attenuation"])  # every 2nd step and the last
    assert any(t.startswith("lnmonitor/invariance/") for t in logged)

    csv = read_csv_scalars(loggers["csv"].experiment.metrics_file_path)
    client = MlflowClient(loggers["mlflow"]._tracking_uri)
    run_id = loggers["mlflow"].run_id
    mlflow_tags = set(client.get_run(run_id).data.metrics)
    for tag, points in logged.items():
        assert [(s, v) for s, v in csv[tag]] == sorted(points.items()), tag
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, tag)]
        assert sorted(history) == sorted(points.items()), tag
        last = points[max(points)]
        assert math.isclose(wandb_summary[tag], last, rel_tol=1e-12), tag
    assert mlflow_tags >= set(logged)

    # the pictures: W&B keeps them as media files, MLflow as artifacts per step
    pictures = sorted(p.name for p in media.rglob("media/images/lnmonitor/*.png"))
    assert any(n.startswith("ladder_over_training") for n in pictures)
    assert sum(n.startswith("ladder_") and "over" not in n for n in pictures) >= 2
    artifacts = {a.path for a in client.list_artifacts(run_id, "lnmonitor/ladder")}
    assert {"lnmonitor/ladder/step_00000000.png", "lnmonitor/ladder/step_00000003.png"} <= artifacts
