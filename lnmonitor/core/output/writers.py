"""Where a monitor's numbers go when no framework logs them (a plain loop): :func:`metric_writer`."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["MetricWriter", "metric_writer", "write_scalars"]

MetricWriter = Callable[[dict[str, float], int], None]


def write_scalars(writer, metrics: dict[str, float], step: int, prefix: str = "") -> bool:
    """Write all ``metrics`` to a TensorBoard ``SummaryWriter`` as one event (``add_scalar`` writes one per
    scalar, ~30 us each); False when ``writer`` is not torch's or tensorboardX's."""
    try:
        from tensorboard.compat.proto.summary_pb2 import Summary

        file_writer = writer._get_file_writer()
        values = [Summary.Value(tag=prefix + k, simple_value=float(v)) for k, v in metrics.items()]
        file_writer.add_summary(Summary(value=values), step)
    except Exception:  # noqa: BLE001 - any other writer: the caller's own path
        return False
    return True


def metric_writer(target, layout: dict[str, dict] | None = None) -> MetricWriter | None:
    """``write(metrics, step)`` for ``target``: a ``SummaryWriter`` (anything with ``add_scalar``; ``layout``,
    the custom-scalars layout, is written to it before the first step), a callable taking
    ``(metrics, step)``, or None (nothing written).  Raises TypeError for anything else."""
    if target is None:
        return None
    if hasattr(target, "add_scalar"):
        state = {"first": True}

        def to_tensorboard(metrics: dict[str, float], step: int) -> None:
            if state["first"] and layout and hasattr(target, "add_custom_scalars"):
                target.add_custom_scalars(layout)
            state["first"] = False
            if not write_scalars(target, metrics, step):
                for tag, value in metrics.items():
                    target.add_scalar(tag, value, step)

        return to_tensorboard
    if callable(target):
        return target
    raise TypeError(f"writer must be a SummaryWriter, a callable write(metrics: dict, step: int) or None, "
                    f"got {type(target).__name__}")
