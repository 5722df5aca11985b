"""The communication-compressed optimizers (stage 0): 1-bit Adam (arXiv 2102.02888), 0/1 Adam (arXiv 2202.06009)
and 1-bit LAMB (arXiv 2104.06069) over zero_comm's 1-bit compressed all-reduce, and the data-parallel runtime that
lets them decide when gradients are all-reduced in full precision."""

from zero.optim.onebit.adam import OneBitAdam
from zero.optim.onebit.lamb import OneBitLamb
from zero.optim.onebit.runtime import CompressedRuntime
from zero.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["CompressedRuntime", "OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
