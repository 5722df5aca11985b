"""Stage-3 leaf modules: a module whose whole subtree of parameters is one unit, gathered when the module is entered
and reduced once (DeepSpeed's ``set_z3_leaf_modules``, ``deepspeed/utils/z3_leaf_module.py``).

Why: a mixture-of-experts block calls only the experts its router picks, and the routing differs between ranks
(each rank has its own tokens). With one unit per expert module, ranks would gather different units; marked as a
leaf, the block's experts are gathered together on every rank whether called or not, and their gradients (zero
where a rank did not use an expert) reduced together. The marks live here, keyed weakly by module (no attribute is
set on the user's modules); ``plan_units`` reads them through :func:`is_leaf`.

Matching by class accepts a class (``isinstance``) or a string: the class's ``__name__`` or its fully qualified
``module.qualname``, as DeepSpeed. The ``zero_optimization.leaf_module`` section (:class:`LeafModuleConfig`) names
classes, module names (``named_modules()`` keys) and name suffixes; its default classes are transformers'
Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks, as DeepSpeed 0.18+.
"""

from __future__ import annotations

import sys
import weakref

import torch

_LEAVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> True (leaf) / False (unset)

DEFAULT_LEAF_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


def is_leaf(module: torch.nn.Module) -> bool:
    """Whether ``module`` is marked as a stage-3 leaf (DeepSpeed's ``z3_leaf_module``)."""
    return bool(_LEAVES.get(module, False))


def set_leaf(module: torch.nn.Module, flag: bool) -> None:
    """Mark (``flag`` True) or unmark ``module`` as a leaf (DeepSpeed's ``set_z3_leaf_module``)."""
    _LEAVES[module] = bool(flag)


def leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` (itself included) marked as leaves, in ``modules()`` order."""
    return [m for m in model.modules() if is_leaf(m)]


def _class_matches(module: torch.nn.Module, spec) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def mark_by_class(model: torch.nn.Module, classes, flag: bool = True, raise_if_not_found: bool = True) -> list:
    """Mark every module of ``model`` matching one of ``classes`` (types, or class names / fully qualified names).

    Returns:
        The matched modules, in ``modules()`` order.

    Raises:
        TypeError: an entry of ``classes`` is neither a type nor a string.
        ValueError: nothing matched and ``raise_if_not_found``.
    """
    classes = list(classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf module classes must be types or class names, got {bad!r}")
    found = [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]
    if not found and raise_if_not_found:
        raise ValueError(f"no module of the classes {classes!r} found in {type(model).__name__}")
    for m in found:
        set_leaf(m, flag)
    return found


def mark_by_name(model: torch.nn.Module, names, flag: bool = True, raise_if_not_found: bool = True):
    """Mark the modules named ``names`` (keys of ``model.named_modules()``). Returns (matched, missing names).

    Raises:
        ValueError: some name matched nothing and ``raise_if_not_found`` (naming them).
    """
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in names:
        if name in by_name:
            set_leaf(by_name[name], flag)
            found.append(by_name[name])
        else:
            missing.append(name)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing!r} in {type(model).__name__}")
    return found, missing


def mark_by_suffix(model: torch.nn.Module, suffixes, flag: bool = True, raise_if_not_found: bool = True):
    """Mark the modules whose ``named_modules()`` name ends with one of ``suffixes``. Returns (matched, missing).

    Raises:
        ValueError: some suffix matched nothing and ``raise_if_not_found`` (naming them).
    """
    found, missing, seen = [], [], set()
    modules = list(model.named_modules())
    for suffix in suffixes:
        hits = [m for name, m in modules if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            set_leaf(m, flag)
            if id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"no module names end with {missing!r} in {type(model).__name__}")
    return found, missing


def apply_leaf_config(model: torch.nn.Module, classes, names, suffixes) -> list[torch.nn.Module]:
    """Mark what a ``zero_optimization.leaf_module`` section names (nothing matching is not an error: the default
    classes are transformers' MoE blocks, absent from most models). Returns the matched modules, each once."""
    found = mark_by_class(model, classes, raise_if_not_found=False) if classes else []
    found += mark_by_name(model, names, raise_if_not_found=False)[0]
    found += mark_by_suffix(model, suffixes, raise_if_not_found=False)[0]
    return list({id(m): m for m in found}.values())


_MAX_LEAF_NUMEL = 1_000_000_000  # a larger subtree never becomes a leaf: its gathered unit would hold too much


def _granularity(module: torch.nn.Module, out: dict) -> tuple[int, int]:
    """``(torch leaf modules, parameter elements)`` of ``module``'s subtree; records each module's granularity
    (elements per layer; ``sys.maxsize``: never a leaf) in ``out``."""
    from zero_core.partition_records import logical_shape

    if next(module.parameters(), None) is None:
        out[module] = sys.maxsize  # no parameters (activations): never a leaf
        return 0, 0
    numel = sum(logical_shape(p).numel() for p in module.parameters(recurse=False))
    children = list(module.children())
    if not children:
        out[module] = sys.maxsize
        return 1, numel
    layers = 0
    for child in children:
        child_layers, child_numel = _granularity(child, out)
        layers, numel = layers + child_layers, numel + child_numel
    if type(module).__name__ in torch.nn.modules.container.__all__:
        out[module] = sys.maxsize  # a ModuleList/Sequential may never run forward itself: its children keep hooks
        return layers, numel
    layers += 1
    out[module] = numel // layers if numel <= _MAX_LEAF_NUMEL else sys.maxsize
    return layers, numel


def mark_by_granularity(model: torch.nn.Module, threshold: int) -> list[torch.nn.Module]:
    """Mark as leaves the outermost modules whose granularity (parameter elements of the subtree divided by its
    layers: torch leaf modules plus non-container modules) is at most ``threshold``, parents before children, as
    DeepSpeed's ``stage3_module_granularity_threshold`` does (``_set_z3_leaf_modules_by_threshold``: few large
    gathers instead of many small ones for models of many small modules). Returns the marked modules."""
    granularity: dict = {}
    _granularity(model, granularity)
    marked: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        if next(module.parameters(), None) is None:
            return
        if granularity[module] <= threshold:
            set_leaf(module, True)
            marked.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return marked
