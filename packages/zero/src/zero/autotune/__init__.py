"""``zero autotune``: the fastest ZeRO configuration that fits, found by short experiments (DeepSpeed's autotuner).

:class:`Autotuner` runs a session; ``zero.autotune.memory`` predicts bytes per rank so that candidates that cannot
fit are never launched; ``zero.autotune.tuners`` holds the grid, random and model-based tuners.
"""

from zero.autotune.autotuner import AutotuneError, Autotuner, Job
from zero.autotune.memory import MemoryModel, ModelInfo, model_state_prediction

__all__ = ["AutotuneError", "Autotuner", "Job", "MemoryModel", "ModelInfo", "model_state_prediction"]
