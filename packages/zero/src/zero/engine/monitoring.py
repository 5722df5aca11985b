"""The engine's side of :mod:`zero.monitoring`: what each optimizer step writes (DeepSpeed's event names)."""

from __future__ import annotations

import torch

from zero.monitoring import Monitor


class MonitorMixin:
    """Mixed into :class:`~zero.engine.Engine`; ``monitor`` is None unless a monitor section is enabled (rank 0)."""

    monitor: Monitor | None = None
    _monitor_loss: float | None = None

    def _start_monitor(self) -> None:
        self.monitor = Monitor.maybe(self.config, self.rank)

    def _monitor_backward(self, loss: torch.Tensor) -> None:
        """Keep the boundary micro-batch's loss as the caller passed it (before the division by the accumulation
        steps; DeepSpeed <= 0.16 divided, then multiplied back for the event)."""
        if self.monitor is not None and self.is_gradient_accumulation_boundary():
            self._monitor_loss = float(loss.detach().float().mean())

    def _monitor_step(self) -> None:
        """After an optimizer step: rank 0 writes this step's events, x-axis ``global_samples``."""
        if self.monitor is None:
            return
        n = self.global_samples
        events = [("Train/Samples/lr", self.get_lr()[0], n)]
        if self._monitor_loss is not None:
            events.insert(0, ("Train/Samples/train_loss", self._monitor_loss, n))
        if self._grad_norm is not None:
            events.append(("Train/Samples/grad_norm", self._grad_norm, n))
        if self.config.fp16.enabled:
            events.append(("Train/Samples/loss_scale", float(self.runtime.loss_scaler.scale), n))
        seconds = self.observer.last_seconds if self.observer is not None else {}
        for phase in ("forward", "backward", "step"):
            if phase in seconds:
                events.append((f"Train/Samples/elapsed_time_ms_{phase}", seconds[phase] * 1e3, n))
        self.monitor.after_step(self.global_steps, events)

    def close_monitor(self) -> None:
        """Flush and close the monitors (also done at interpreter exit by the writers' own handlers)."""
        if self.monitor is not None:
            self.monitor.close()
