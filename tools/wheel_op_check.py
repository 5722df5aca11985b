"""zero-kernels installed from its wheel builds and loads its CPU Adam op (run by ``nox -s isolation``).

Run in a venv that holds the wheel (not the source tree) with ``$ZERO_KERNELS_CACHE`` pointing at an empty folder:
the op's C++ sources must come from the installed package, the build must land in that cache, and one step of the
built op must equal the torch reference (AdamW, fp32, 4099 elements: the SIMD body and its scalar tail) within
1e-6 (relative, and absolute near zero). Exit status 0 on success; an AssertionError or zero_kernels.BuildError
otherwise.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch

import zero_kernels
from zero_kernels import loader


def main() -> int:
    installed = pathlib.Path(zero_kernels.__file__).resolve().parent
    assert "site-packages" in installed.parts, f"zero_kernels imported from {installed}, not an installed wheel"
    sources = sorted(p.name for p in (installed / "csrc" / "cpu_adam").iterdir())
    assert "binding.cpp" in sources, f"the wheel lacks the CPU Adam sources: {sources}"
    cache = pathlib.Path(os.environ["ZERO_KERNELS_CACHE"])
    assert not any(cache.rglob("*.so")), f"{cache} already holds a built op: the check must build it"
    op = zero_kernels.load("cpu_adam")
    built = pathlib.Path(op.__file__).resolve()
    assert cache.resolve() in built.parents, f"cpu_adam loaded from {built}, not built into {cache}"
    torch.manual_seed(0)
    n = 4099
    param, grad = torch.randn(n), torch.randn(n)
    ref = [param.clone(), grad, torch.zeros(n), torch.zeros(n)]
    got = [param.clone(), grad, torch.zeros(n), torch.zeros(n)]
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    zero_kernels.adam_step_reference(*ref, **kw)
    zero_kernels.adam_step(*got, use_op=True, **kw)
    # the SIMD body and the reference differ by 1-2 ulp (atol for values near zero), as in the package's tests
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[3], ref[3], rtol=1e-6, atol=1e-6)
    assert not torch.equal(got[0], param), "the step left the parameters unchanged"
    print(f"zero_kernels {zero_kernels.__version__} from {installed}: cpu_adam built into {built.parent} "
          f"({loader.cache_root()}), one step equals the torch reference")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
