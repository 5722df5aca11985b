"""``Engine.destroy()`` (DeepSpeed's ``engine.destroy()``): detach the runtime, leaving a plain module."""

from __future__ import annotations


class LifecycleMixin:
    """Mixed into ``zero.engine.Engine``; expects ``self.runtime``, ``self.observer`` and ``self.mpu``."""

    def destroy(self) -> None:
        """Collective (stage 3 gathers each unit once). Every hook zero installed is removed and ``module`` keeps
        plain dense parameters holding the trained values, so it can be used, saved or wrapped again; the
        engine cannot train afterwards. Idempotent.
        ``deepspeed.utils.groups`` stops answering from this engine's sequence-parallel mpu."""
        from zero.utils import groups

        if self.mpu is not None and groups.mpu is self.mpu:
            groups.mpu = None
        self.runtime.close()
        if self.observer is not None:
            self.observer.close()
