"""ZeRO stages 0-3 (arXiv 1910.02054): flat range-sharded buffers, mixed precision, loss scaling, zero_init.

Public interface: :class:`ZeroRuntime`, :class:`StepResult`, :class:`ZeroConfig`, :class:`PrecisionPolicy`,
:class:`DynamicLossScaler`, :class:`StaticLossScaler`, :class:`FlatGroup`, :class:`Bucket`, :class:`ParamSlot`
(the one frozen layout, ``zero_core.layout``), :class:`ShardState`,
:func:`model_state_bytes`, :func:`zero_init`, :class:`GatheredParameters`, :func:`gathered_for_compute` (units held
for sequence-tiled compute), :class:`RankDivergenceError`,
:class:`MissingRanksError` (a stage-3 gather some ranks never joined, e.g. a forward run on some ranks only),
:func:`register_external_parameter`, :class:`ExternalParameterError`, :class:`UnknownOutputError`.

The seam (variation points, each a protocol in its own module, chosen from the config and overridable by keyword
in ``ZeroRuntime``): :class:`ParamStore` (``param_store``: a builder given :class:`ParamStoreInputs`, with
:class:`Stage3Settings`; default :class:`DenseParamStore` / ``stage3.Stage3``, whose stored shards live where a
:class:`ShardStorage` says),
:class:`GradReduction` (``grad_reduction``: a builder given :class:`ReductionInputs`; default
``reducer.GradReducer``), :class:`MasterStore` (``master_store``: a builder given :class:`MasterStoreInputs`;
default :class:`DeviceMaster`), with :class:`StepDecision`.
"""

from importlib.metadata import version as _version

from zero_core.config import OffloadConfig, ZeroConfig
from zero_core.deferred_init import defer_init
from zero_core.external import ExternalParameterError, register_external_parameter
from zero_core.gathered import GatheredParameters, gathered_for_compute
from zero_core.grad_reduction import GradReduction, ReductionInputs
from zero_core.layout import Bucket, FlatGroup, LayoutError, ParamSlot
from zero_core.master import MasterStore, MasterStoreInputs, StepDecision
from zero_core.master_device import DeviceMaster
from zero_core.memory import model_state_bytes
from zero_core.param_store import DenseParamStore, ParamStore, ParamStoreInputs, Stage3Settings
from zero_core.precision import DynamicLossScaler, PrecisionPolicy, StaticLossScaler
from zero_core.runtime import StepResult, ZeroRuntime
from zero_core.shard_state import ShardState
from zero_core.shard_storage import ShardStorage
from zero_core.stage3 import RankDivergenceError
from zero_core.stage3_errors import MissingRanksError
from zero_core.tree import UnknownOutputError
from zero_core.zenflow_config import ZenFlowConfig
from zero_core.zero_init import zero_init

__version__ = _version("zero-core")  # the one version lives in pyproject.toml; read from the installed metadata

__all__ = [
    "defer_init",
    "Bucket",
    "DenseParamStore",
    "DeviceMaster",
    "DynamicLossScaler",
    "ExternalParameterError",
    "FlatGroup",
    "GatheredParameters",
    "gathered_for_compute",
    "GradReduction",
    "LayoutError",
    "MasterStore",
    "MasterStoreInputs",
    "MissingRanksError",
    "OffloadConfig",
    "ParamSlot",
    "ParamStore",
    "ParamStoreInputs",
    "PrecisionPolicy",
    "RankDivergenceError",
    "ReductionInputs",
    "ShardState",
    "ShardStorage",
    "Stage3Settings",
    "StaticLossScaler",
    "StepDecision",
    "StepResult",
    "UnknownOutputError",
    "ZenFlowConfig",
    "ZeroConfig",
    "ZeroRuntime",
    "model_state_bytes",
    "register_external_parameter",
    "zero_init",
]
