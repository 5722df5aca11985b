"""``deepspeed.launcher``: the launcher constants Accelerate reads (``accelerate launch --use_deepspeed``).

Launching itself is ``zero run`` (``zero.commands.run``); ``runner`` holds DeepSpeed's module-level names.
"""

from zero.launcher import runner

__all__ = ["runner"]
