"""The stores a feature puts in place of the core's own: each of ``zero_core.ZeroRuntime``'s seams
(``param_store``, ``grad_reduction``, ``master_store``) is filled by at most one feature.

DeepCompile's compiled path fills the parameter store and the gradient reduction (``compile.deepcompile``) and, with
``compile.offload_opt_states``, the master store; ``zero_optimization.offload_optimizer`` fills the master store and
``zero_optimization.offload_param`` the parameter store. Two features on one seam would have one silently replace
the other's store; the engine refuses the pair instead, naming both keys.
"""

from __future__ import annotations

from zero.config import ConfigError

SEAMS = ("param_store", "grad_reduction", "master_store")
"""The keyword arguments of ``zero_core.ZeroRuntime`` that take a replacement store."""


class SeamClaims:
    """The stores claimed so far, by seam, and the config key of the feature that claimed each.

    Attributes:
        stores: seam -> store, the keyword arguments for ``ZeroRuntime``.
        claimed_by: seam -> the config key of the feature whose store it is.
    """

    def __init__(self):
        self.stores: dict[str, object] = {}
        self.claimed_by: dict[str, str] = {}

    def claim(self, seam: str, store: object | None, feature: str) -> None:
        """Put ``store`` (None: the feature is off, nothing claimed) on ``seam`` for ``feature`` (its config key).

        Raises:
            ValueError: ``seam`` is not one of :data:`SEAMS`.
            ConfigError: another feature already claimed ``seam`` (both keys named).
        """
        if seam not in SEAMS:
            raise ValueError(f"unknown seam {seam!r}; expected one of {SEAMS}")
        if store is None:
            return
        if seam in self.stores:
            raise ConfigError(f"{self.claimed_by[seam]} and {feature} both replace zero's {seam.replace('_', ' ')}; "
                              "they cannot be combined: set one of them")  # fmt: skip
        self.stores[seam] = store
        self.claimed_by[seam] = feature
