"""Stage 3's check of released reads on the first pass: until the unit order is recorded, the root module's forward
runs under ``zero_core.external.ReleasedReadCheck``, so a parameter read outside the forward of the module owning
it (and never declared with ``register_external_parameter``) raises with its name instead of failing later on an
empty tensor. Once the order is recorded the hooks go (a steady forward pays nothing for the check); forgetting
the order (``empty_partition_cache``) installs them again."""

from __future__ import annotations

import torch

from zero_core.external import ReleasedReadCheck

__all__ = ["FirstPassCheck", "eager"]


def eager(hook):
    """``hook`` run eagerly under ``torch.compile`` (Dynamo cannot trace collectives or ``.data`` swaps). Wrapped
    when the hook is registered, not at import: ``torch.compiler.disable`` imports Dynamo, seconds of start-up that
    a process never compiling (the ``zero`` CLI, a launcher) should not pay."""
    return torch.compiler.disable(hook)


class FirstPassCheck:
    """The released-read check on ``module``'s forwards while ``prefetch.order`` is None.

    Args:
        module: the root module.
        names: ``id(param)`` -> name of every parameter of a non-persistent unit (named in the error).
        prefetch: the store's ``zero_core.prefetch.Prefetcher`` (its ``order``: None until recorded).
    """

    def __init__(self, module: torch.nn.Module, names: dict[int, str], prefetch):
        self.module, self.names, self.prefetch = module, names, prefetch
        self.check: ReleasedReadCheck | None = None  # the mode entered by this forward, exited when it ends
        self.hooks: list = []
        self.watch()

    @property
    def active(self) -> bool:
        """True while the next forward runs under the check (no order recorded)."""
        return self.prefetch.order is None

    def watch(self) -> None:
        """Install the root's hooks (again, after the order was forgotten)."""
        if self.hooks:
            return
        m = self.module
        # always_call: a forward that raises (e.g. RankDivergenceError) must not leave the check mode active
        self.hooks = [m.register_forward_pre_hook(eager(self._enter), prepend=True),
                      m.register_forward_hook(eager(self.end), always_call=True)]  # fmt: skip

    def stop(self) -> None:
        """The order is recorded: remove the hooks (unless a forward is still under the check)."""
        if self.hooks and self.check is None and self.prefetch.order is not None:
            for h in self.hooks:
                h.remove()
            self.hooks = []

    def _enter(self, module, args) -> None:
        if self.prefetch.order is None and self.check is None and torch._C._current_graph_task_id() == -1:
            self.check = ReleasedReadCheck(self.names)
            self.check.__enter__()

    def end(self, module=None, args=None, output=None) -> None:
        """Leave the check mode, if this forward entered it."""
        if self.check is not None:
            check, self.check = self.check, None
            check.__exit__(None, None, None)

    def close(self) -> None:
        """Remove the hooks; leave a check mode a forward that never finished entered."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.end()
