"""Training monitors configured by DeepSpeed's `tensorboard`, `wandb`, `csv_monitor` and `comet` sections.

Events and their names are DeepSpeed's: after every optimizer step rank 0 writes ``Train/Samples/train_loss``
(rank 0's loss of the step's last micro-batch, as DeepSpeed <= 0.16's engine wrote it; 0.19 writes it only
from its pipeline engine),
``Train/Samples/lr`` (first param group), ``Train/Samples/loss_scale`` (fp16 only) and, with
``wall_clock_breakdown``, ``Train/Samples/elapsed_time_ms_{forward,backward,step}``; zero adds
``Train/Samples/grad_norm`` (the global pre-clip norm). The x-axis (``step``) is the number of samples trained
(``global_samples``), as DeepSpeed. Writers are flushed every ``steps_per_print`` steps and when the engine
closes its monitor. A monitor whose library is missing is a ConfigError naming the extra to install
(``pip install 'zero[tensorboard]'``, ``zero[wandb]``, ``zero[comet]``).
"""

from zero.monitoring.config import CometSection, CSVSection, TensorBoardSection, WandbSection
from zero.monitoring.master import Monitor

__all__ = ["CSVSection", "CometSection", "Monitor", "TensorBoardSection", "WandbSection"]
