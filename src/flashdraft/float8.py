"""train.fp8: the drafter's linear layers as torchao's Float8Linear, checked against the device, with the
float8 step's graphs made cacheable by AOTAutograd (so a warm process loads them instead of tracing)."""

from __future__ import annotations

import sys
from dataclasses import is_dataclass

import torch

from .config_check import fp8_problem
from .errors import UserError


def float8_linears(model: torch.nn.Module, recipe: str, device: torch.device) -> None:
    """train.fp8: the model's linear layers as torchao's Float8Linear (same parameters, so checkpoints
    and the export are unchanged; the matmuls run in float8 with `recipe`'s scales)."""
    on_gpu, gpus = device.type == "cuda", []
    if on_gpu:
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpus = [(index, torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))]
    try:
        import torchao.float8  # noqa: F401

        torchao = True
    except ImportError:
        torchao = False
    # the workflow checked this before its first job (flashdraft.config_check.check_fp8_gpus): here again for
    # whatever runs the trainer another way
    problem = fp8_problem(recipe, on_gpu, gpus, torchao)
    if problem:
        raise UserError(problem)
    to_float8(model, recipe)


def to_float8(model: torch.nn.Module, recipe: str) -> None:
    """The conversion float8_linears makes, on any device (the CPU runs float8 matmuls too, slowly)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def fits(module, _name):  # float8 matmuls need both dimensions in multiples of 16
        return (
            isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, module_filter_fn=fits, config=config)
    float8_graphs_cacheable()


_FLOAT8_MODULES = (
    "torchao.float8.float8_training_tensor",
    "torchao.float8.config",
    "torchao.float8.float8_linear",
    "torchao.float8.float8_scaling_utils",
    "torchao.float8.distributed_utils",
    "torchao.float8.float8_utils",
)


def float8_graphs_cacheable() -> None:
    """Let AOTAutograd cache the float8 step, so a warm process loads its joint graph instead of tracing it
    again (seconds at the production shape). AOTAutograd bypasses its cache for a graph that calls what it
    cannot name: torchao's config classes, and the wrapper Dynamo builds around each autograd.Function's
    apply (a local function, a new one per call). Here each torchao Function gets one wrapper, an
    attribute of this module, and those names and torchao's classes are marked cacheable under torchao's
    version (part of the cache key). Functions of other packages keep Dynamo's own wrapper."""
    import importlib
    import inspect

    import torchao
    from torch._dynamo.variables import misc

    if getattr(misc.produce_trampoline_autograd_apply, "_flashdraft", False):
        return
    marked = torch._inductor.config.unsafe_marked_cacheable_functions
    module = sys.modules[__name__]
    for name in _FLOAT8_MODULES:
        for value in vars(importlib.import_module(name)).values():
            if not (inspect.isclass(value) and value.__module__ == name):
                continue
            if issubclass(value, torch.autograd.Function):
                marked[f"{module.__name__}.{_apply_name(value)}"] = torchao.__version__
            elif is_dataclass(value) or issubclass(value, tuple):  # the recipe's config data
                marked[f"{name}.{value.__name__}"] = torchao.__version__
    dynamo_wrapper = misc.produce_trampoline_autograd_apply

    def wrapper(fn_cls):
        if fn_cls.__module__ not in _FLOAT8_MODULES:
            return dynamo_wrapper(fn_cls)
        name = _apply_name(fn_cls)
        if not hasattr(module, name):

            def apply(*args, **kwargs):
                return fn_cls.apply(*args, **kwargs)

            apply.__name__ = apply.__qualname__ = name
            apply.__module__ = module.__name__
            apply._origin = misc.produce_trampoline_autograd_apply  # Dynamo's mark for "trace into me"
            setattr(module, name, apply)
        return getattr(module, name)

    wrapper._flashdraft = True
    misc.produce_trampoline_autograd_apply = wrapper


def _apply_name(fn_cls) -> str:
    return f"_apply_{fn_cls.__module__}_{fn_cls.__qualname__}".replace(".", "_")
