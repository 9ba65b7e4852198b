"""Run a transformers model or a diffusers pipeline on this package's layers with one call.

    kernel = get_kernel("ltx-kernels/ltx-kernels", version=1, trust_remote_code=True)  # or get_local_kernel(path)

    pipe.to("cuda")                               # first move the model,
    counts = kernel.kernelize_diffusers(pipe)     # then kernelize (its transformer / unet),
    pipe.enable_model_cpu_offload()               # and only then install offload hooks, if any

    model = AutoModelForCausalLM.from_pretrained(..., device_map="cuda")
    counts = kernel.kernelize_transformers(model)  # {"RMSNorm": 145, "ApplyRotaryPosEmb": 36, ...}

Both return how many modules each layer replaced and refuse, with a message saying what to
do, when the model is on no single device type, still on the meta device, behind CPU or
group offload hooks, or holds nothing these layers replace. The layers are this package's
own (the variant that was loaded); ``repo=Path(...)`` takes them from another build
(``backend="cpu"`` for its CPU variant), ``repo="ltx-kernels/ltx-kernels"`` from the Hub
(version 1, or ``revision=``; kernels' ``LOCAL_KERNELS`` override applies to it).

kernels, transformers and diffusers are imported inside the functions: the kernel package
itself needs only torch.

transformers declares hub hooks itself (``"RMSNorm"``, ``"RMSNormZeroCentered"``,
``"GeluTanh"``, ``"rotary_pos_emb"``); Gemma's RMSNorm classes and the diffusers classes
have none, so this module tags them with ``kernels.replace_kernel_forward_from_hub`` (with a
condition that leaves configurations the layers do not fuse, such as affine norms or
custom attention processors, on their stock forward). `kernels.kernelize` replaces the
forward of every tagged module in the model: ours where this mapping has a layer, the
stock forward everywhere else. transformers' hooks do nothing unless its kernels pin is
met; `kernelize_transformers` then refuses, naming the versions that work together.

A hooked function such as transformers' ``apply_rotary_pos_emb`` runs through a wrapper
module: with kernels >= 0.18 one per module that calls it (each attention module, so each
model instance has its own), with kernels 0.17 one per model file, shared by every model of
that type. Both are counted and restored as modules; `unkernelize` puts the stock forwards
back.

Other libraries' hooks stay, in either order: diffusers' hooks (context parallelism,
First-Block-Cache and the other caches), transformers' parallel styles and accelerate's hooks
wrap a module's instance ``forward``, which kernelize rebinds; both calls set those wrappers
aside and put them back around the module's new forward (ours inside theirs). A wrapper
this module cannot see into is refused with the order that works. The layer subclasses get
diffusers' block metadata (its cache hooks look blocks up by class).
"""

import contextlib
import dataclasses
import functools
import importlib
import logging
import sys
from pathlib import Path
from types import MethodType
from typing import Dict, Iterator, Optional, Union

import torch

from . import layers
from .fp8_linear import FP8Linear, apply_fp8_plan, fp8_plan, restore_linears, undo_fp8_plan
from .layers import _host

__all__ = ["diffusers_mapping", "kernelize_diffusers", "kernelize_transformers", "replaced_modules",
           "transformers_mapping", "unkernelize"]

HUB_REPO_ID = "ltx-kernels/ltx-kernels"
HUB_VERSION = 1
DEVICES = ("cuda", "cpu")

# transformers hook name -> our layer.
TRANSFORMERS_LAYERS = {
    "RMSNorm": "RMSNorm",
    "RMSNormZeroCentered": "RMSNormZeroCentered",
    "GeluTanh": "GeluTanh",
    "rotary_pos_emb": "ApplyRotaryPosEmb",
}
# transformers classes without a hook, tagged here: "module:Class" -> hook name.
TRANSFORMERS_TAGGED = {
    "transformers.models.gemma.modeling_gemma:GemmaRMSNorm": "RMSNormZeroCentered",
    "transformers.models.gemma2.modeling_gemma2:Gemma2RMSNorm": "RMSNormZeroCentered",
    "transformers.models.gemma3.modeling_gemma3:Gemma3RMSNorm": "RMSNormZeroCentered",
}
# diffusers classes, tagged here: "module:Class" -> our layer (also the hook name).
DIFFUSERS_LAYERS = {
    "diffusers.models.normalization:RMSNorm": "DiffusersRMSNorm",
    "diffusers.models.activations:GEGLU": "GEGLU",
    "diffusers.models.activations:GELU": "DiffusersGELU",
    "diffusers.models.attention:FeedForward": "FeedForward",
    "diffusers.models.normalization:AdaLayerNormZero": "AdaLayerNormZero",
    "diffusers.models.normalization:AdaLayerNormZeroSingle": "AdaLayerNormZeroSingle",
    "diffusers.models.normalization:AdaLayerNormContinuous": "AdaLayerNormContinuous",
    "diffusers.models.transformers.transformer_ltx:LTXVideoTransformerBlock": "LTXVideoTransformerBlock",
    "diffusers.models.transformers.transformer_ltx:LTXAttention": "LTXAttention",
    "diffusers.models.transformers.transformer_ltx:LTXVideoRotaryPosEmbed": "LTXVideoRotaryPosEmbed",
}
# The pipeline components kernelize_diffusers kernelizes.
DIFFUSERS_COMPONENTS = ("transformer", "transformer_2", "unet")
# transformers releases and the kernels releases their hub hooks work with (their pins).
TRANSFORMERS_KERNELS_PAIRS = (
    ("transformers >= 5.25", "kernels >= 0.19.1, < 0.20"),
    ("transformers 5.23 and 5.24", "kernels >= 0.18.2, < 0.19"),
    ("transformers 5.22", "kernels >= 0.17.2, < 0.18"),
)

Repo = Union[str, Path, None]


class _PackageLayer:
    """A layer of this package itself, the variant this module was loaded from: the
    repository interface `kernels.kernelize` uses (``load()`` returns the layer class;
    equality and hash key kernels' cache of loaded layers)."""

    def __init__(self, layer_name: str):
        self.layer_name = layer_name

    def load(self):
        return getattr(layers, self.layer_name)

    def __eq__(self, other):
        return type(other) is type(self) and other.layer_name == self.layer_name

    def __hash__(self):
        return hash((__name__, self.layer_name))

    def __str__(self):
        return f"`{__package__}` (the loaded package, layer `{self.layer_name}`)"


class _VariantRepository:
    """A local build's layer from one variant (kernels' LocalLayerRepository loads the
    variant of torch's backend; this one can load the CPU variant under a CUDA torch)."""

    def __init__(self, path: Path, layer_name: str, backend: str):
        self.path, self.layer_name, self.backend = path, layer_name, backend

    def load(self):
        from kernels import get_local_kernel

        return getattr(get_local_kernel(self.path, backend=self.backend).layers, self.layer_name)

    def __eq__(self, other):
        return isinstance(other, _VariantRepository) and (self.path, self.layer_name, self.backend) == (
            other.path, other.layer_name, other.backend)

    def __hash__(self):
        return hash((self.path, self.layer_name, self.backend))

    def __str__(self):
        return f"`{self.path}` ({self.backend} variant, layer `{self.layer_name}`)"


def _repository(layer_name: str, repo: Repo, backend: Optional[str], revision: Optional[str],
                trust_remote_code: bool):
    from kernels import LayerRepository, LocalLayerRepository

    if repo is None:
        if backend is not None or revision is not None:
            raise ValueError("backend= and revision= pick another build (with repo=): without repo= the layers "
                             "are the loaded package's own")
        return _PackageLayer(layer_name)
    if isinstance(repo, Path):
        if backend is not None:
            return _VariantRepository(repo, layer_name, backend)
        return LocalLayerRepository(repo, layer_name=layer_name)
    if backend is not None:
        raise ValueError("backend= picks a variant of a local build; the Hub picks torch's variant itself")
    if revision is not None:
        return LayerRepository(repo, layer_name=layer_name, revision=revision, trust_remote_code=trust_remote_code)
    return LayerRepository(repo, layer_name=layer_name, version=HUB_VERSION, trust_remote_code=trust_remote_code)


def kernel_mapping(hooks: Dict[str, str], repo: Repo = None, *, backend: Optional[str] = None,
                   revision: Optional[str] = None, trust_remote_code: bool = False) -> dict:
    """The `kernels.use_kernel_mapping` mapping from hook names to our layers (for CUDA and
    CPU). ``repo``: None for this package's own layers, a local checkout or build (Path;
    ``backend`` picks its variant), or a Hub repo id (str; version 1, or ``revision``;
    ``trust_remote_code`` as for `kernels.get_kernel`)."""
    return {hook: {device: _repository(layer, repo, backend, revision, trust_remote_code) for device in DEVICES}
            for hook, layer in hooks.items()}


def transformers_mapping(repo: Repo = None, **kwargs) -> dict:
    """The mapping for transformers' hooks: ``with use_kernel_mapping(transformers_mapping()):
    kernelize(model, mode=Mode.INFERENCE)``. Tags Gemma's RMSNorm classes first."""
    _tag(TRANSFORMERS_TAGGED)
    return kernel_mapping(TRANSFORMERS_LAYERS, repo, **kwargs)


def diffusers_mapping(repo: Repo = None, **kwargs) -> dict:
    """The mapping for the diffusers classes, after tagging them."""
    _tag(DIFFUSERS_LAYERS, conditions=_DIFFUSERS_CONDITIONS)
    return kernel_mapping({layer: layer for layer in DIFFUSERS_LAYERS.values()}, repo, **kwargs)


def kernelize_transformers(model: torch.nn.Module, repo: Repo = None, *, device: Optional[str] = None,
                           mode=None, **kwargs) -> Dict[str, int]:
    """Kernelize a transformers model (after ``.to(device)``); returns the number of
    modules each layer replaced (a hooked function counts once per wrapper: per attention
    module with kernels >= 0.18). ``mode``: a `kernels.Mode`, ``Mode.INFERENCE`` by default.
    Hooked ``apply_rotary_pos_emb`` functions whose math is not the Llama rotation this
    layer computes are put back to stock (see `ApplyRotaryPosEmb`).

    With ``Mode.TORCH_COMPILE`` in ``mode`` the model is put back to stock (`unkernelize`)
    and the result is ``{}``; ``repo`` and ``kwargs`` are then unused. Under torch.compile
    these layers run the host's code anyway (inductor fuses it with its neighbours, see the
    layers' ``_under_torch_compile``), and the per-module forwards kernelize installs would
    only add dynamo guards."""
    from kernels import Mode, kernelize, use_kernel_mapping

    mode = Mode.INFERENCE if mode is None else mode
    device = _check_ready(model, device, "model")
    inert = _inert_transformers_hooks()
    if inert:
        raise RuntimeError(inert)
    _tag(TRANSFORMERS_TAGGED)
    hooked = [m for m in _hooked(model) if type(m).kernel_layer_name in TRANSFORMERS_LAYERS]
    if not hooked:
        raise _nothing_to_replace(model)
    if Mode.TORCH_COMPILE in mode:
        unkernelize(model)
        return {}
    with _wrappers_set_aside(model, "kernelize"):
        _relink_copied_functions(model)
        with use_kernel_mapping(transformers_mapping(repo, **kwargs), inherit_mapping=False), \
                _quiet_unmapped_hooks():
            kernelize(model, mode=mode, device=device)
        if not replaced_modules(model, TRANSFORMERS_LAYERS.values()) and mode == Mode.INFERENCE:
            unkernelize(model)
            raise RuntimeError(f"kernelize bound none of the {len(hooked)} hooked modules of "
                               f"{type(model).__name__} to ltx-kernels' layers ({_versions()})")
        _keep_only_matching_rotary(model)
    counts = replaced_modules(model, TRANSFORMERS_LAYERS.values())
    if not counts:
        unkernelize(model)
        raise _nothing_to_replace(model, _mode_note(mode))
    return counts


def kernelize_diffusers(pipeline_or_model, repo: Repo = None, *, device: Optional[str] = None,
                        mode=None, fp8: bool = False, fp8_fast_accum: bool = False, **kwargs) -> Dict[str, int]:
    """Kernelize a diffusers pipeline's transformer / unet, or a diffusers model itself
    (after ``.to(device)``, before ``enable_model_cpu_offload()``); returns the number of
    modules each layer replaced, over all components. ``mode``: a `kernels.Mode`,
    ``Mode.INFERENCE`` by default.

    ``fp8=True`` also turns the attention and feed-forward linears of the transformer
    blocks into `FP8Linear` (FP8 GEMMs with per-token and per-channel scales, counted under
    ``"FP8Linear"``; ``fp8_fast_accum`` as there), and diffusers' ``FeedForward`` with them
    into the `layers.FeedForward` layer (its GELU written as FP8 between the GEMMs);
    refused, before anything changes, for a model in training mode, a GPU below compute
    capability 8.9, a CUDA model not in bfloat16, and LoRA-wrapped linears.

    Each replaced module then runs its layer's forward from a subclass of its class (same
    name, `isinstance` holds; `unkernelize` puts the class back), not from the per-instance
    forward kernelize binds, which dynamo guards with each module's hook dicts (see
    `_forwards_into_classes`)."""
    from kernels import Mode, kernelize, use_kernel_mapping

    mode = Mode.INFERENCE if mode is None else mode
    models = _diffusers_models(pipeline_or_model)
    devices = {name: _check_ready(model, device, name) for name, model in models.items()}
    mapping = diffusers_mapping(repo, **kwargs)
    counts: Dict[str, int] = {}
    fp8_plans = {name: fp8_plan(model) for name, model in models.items()} if fp8 else {}
    converted_before = sum(isinstance(m, FP8Linear) for model in models.values() for m in model.modules())
    if fp8 and not any(fp8_plans.values()) and not converted_before:
        raise ValueError(f"fp8: {', '.join(f'{n} ({type(m).__name__})' for n, m in models.items())} has no "
                         "attention or feed-forward linear in its transformer blocks to convert")
    for name, model in models.items():
        _wrapper_chains(model, "kernelize")  # refuse before changing any component
    try:
        # The FP8 linears first: the FeedForward layer's condition reads them.
        converted = sum(apply_fp8_plan(plan, fast_accum=fp8_fast_accum) for plan in fp8_plans.values())
        with use_kernel_mapping(mapping, inherit_mapping=False), _quiet_unmapped_hooks():
            for name, model in models.items():
                with _wrappers_set_aside(model, "kernelize"):
                    _classes_back(model)  # kernelize reads each module's class (its condition, its forward)
                    kernelize(model, mode=mode, device=devices[name])
                    _forwards_into_classes(model)
                for layer, count in replaced_modules(model, DIFFUSERS_LAYERS.values()).items():
                    counts[layer] = counts.get(layer, 0) + count
        if not counts:
            raise ValueError(f"{', '.join(f'{n} ({type(m).__name__})' for n, m in models.items())} has no module "
                             f"ltx-kernels replaces (supported: "
                             f"{', '.join(c.split(':')[1] for c in DIFFUSERS_LAYERS)}){_mode_note(mode)}")
    except BaseException:
        for model in models.values():
            _unkernelize_layers(model)
        for plan in fp8_plans.values():  # this call's conversions only, the originals put back
            undo_fp8_plan(plan)
        raise
    if converted + converted_before:
        counts["FP8Linear"] = converted + converted_before
    return counts


def replaced_modules(model: torch.nn.Module, layers=None) -> Dict[str, int]:
    """How many modules (and hooked-function wrappers) of ``model`` run one of our layers,
    per layer name (``layers`` limits the names counted)."""
    counts: Dict[str, int] = {}
    for module in _hooked(model):
        func = _running_forward(module)
        if func is _host(module).forward:
            continue
        layer = getattr(func, "__qualname__", "").split(".")[0]
        if (layers is None or layer in layers) and (getattr(func, "__module__", None) or "").endswith(".layers"):
            counts[layer] = counts.get(layer, 0) + 1
    return counts


def unkernelize(model: torch.nn.Module) -> None:
    """Every hooked module and hooked-function wrapper of ``model`` back to its stock
    forward (with kernels 0.17 a function's wrapper is shared by its model file), and every
    `FP8Linear` back to its ``nn.Linear``. Hooks
    other libraries wrapped around a module's forward (diffusers' context-parallel and
    cache hooks, transformers' parallel styles, accelerate's hooks) stay, now around the
    stock forward."""
    _unkernelize_layers(model)
    restore_linears(model)


def _unkernelize_layers(model: torch.nn.Module) -> None:
    """unkernelize without the FP8 linears."""
    with _wrappers_set_aside(model, "unkernelize"):
        for module in _hooked(model):
            vars(module).pop("forward", None)
            vars(module).pop("_kernel_repo", None)
            if not _class_back(module) and hasattr(type(module), "_ltx_host"):
                # a class another library derived from ours (parametrize, FSDP)
                module.forward = MethodType(type(module)._ltx_host.forward, module)


# ---------------------------------------------------------------------------------------


def _versions() -> str:
    import kernels
    import transformers

    return f"transformers {transformers.__version__}, kernels {kernels.__version__}"


@functools.lru_cache(maxsize=None)
def _inert_transformers_hooks() -> Optional[str]:
    """None when transformers' hub-kernel decorators tag what they decorate; else why not,
    with the versions that work. transformers replaces them with no-op stubs when the
    installed kernels is outside its pin: its models then have nothing to kernelize."""
    try:
        from transformers.integrations import hub_kernels

        probe, module = _probe_hooks(hub_kernels.use_kernel_forward_from_hub, hub_kernels.use_kernelized_func)
        if hasattr(probe, "kernel_layer_name") and getattr(module, "_kernel_funcs", None):
            return None
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    try:
        from transformers.utils import import_utils

        low, high = import_utils.KERNELS_MIN_VERSION, import_utils.KERNELS_MAX_VERSION
        pin = f"kernels >= {low}, < {high} (pip install 'kernels>={low},<{high}')"
    except (ImportError, AttributeError):
        pin = "another kernels"
    return (f"transformers' hub-kernel hooks are inert ({_versions()}), so nothing in its models can be "
            f"kernelized: this transformers takes {pin}. Versions that work together: "
            f"{'; '.join(f'{t} with {k}' for t, k in TRANSFORMERS_KERNELS_PAIRS)}")


def _nothing_to_replace(model: torch.nn.Module, note: str = "") -> ValueError:
    return ValueError(f"{type(model).__name__} has no module ltx-kernels replaces (hooks it maps: "
                      f"{', '.join(TRANSFORMERS_LAYERS)}; Gemma's RMSNorm){note}")


def _mode_note(mode) -> str:
    from kernels import Mode

    if mode == Mode.INFERENCE:
        return ""
    return (f"; under {mode} kernelize keeps the stock forward of layers without a backward or without "
            "torch.compile support (every layer here has both)")


def _hooked(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The modules kernelize binds: tagged modules and the wrapper modules of hooked
    functions attached through `use_kernelized_func` (``_kernel_funcs``: one per attention
    module with kernels >= 0.18, the model file's shared one with 0.17), each once."""
    seen = set()
    for module in model.modules():
        for hooked in (module, *getattr(module, "_kernel_funcs", {}).values()):
            if hasattr(type(hooked), "kernel_layer_name") and id(hooked) not in seen and _in_play(hooked):
                seen.add(id(hooked))
                yield hooked


def _in_play(module: torch.nn.Module) -> bool:
    """kernelize binds it (its condition holds), or has bound it (a layer's class, or a
    forward bound to the instance): a tagged module kernelize leaves alone, and any forward
    another library installed on it, are left as they are."""
    condition = getattr(type(module), "kernel_condition", None)  # kernels releases without conditions: none
    return "_ltx_host" in vars(type(module)) or "_kernel_repo" in vars(module) or condition is None or condition(module)


def _running_forward(module: torch.nn.Module):
    """The function ``module(...)`` runs as its own forward: inside the wrappers other
    libraries put around it, if any (an unknown wrapper is returned as it is)."""
    bound = vars(module).get("forward")
    try:
        chain = _wrapper_chain(module, "")
    except ValueError:
        return bound
    if chain:
        bound = chain[-1].get()
    return bound.__func__ if isinstance(bound, MethodType) else type(module).forward


# ---------------------------------------------------------------------------------------
# Other libraries' forward wrappers. diffusers' hooks (context parallelism, First-Block-Cache
# and the other caches), transformers' tensor-parallel styles and accelerate's hooks replace
# a module's instance ``forward`` with a wrapper that calls the forward it found there. kernelize
# (and unkernelize) rebind that instance forward, which would drop the wrapper: they work
# with the wrappers set aside, then put them back around the module's new own forward.


class _Slot:
    """Where a wrapper keeps the forward it calls: an attribute of an object, or a closure
    cell."""

    def __init__(self, holder, name: Optional[str] = None):
        self.holder, self.name = holder, name

    def get(self):
        return self.holder.cell_contents if self.name is None else getattr(self.holder, self.name)

    def set(self, forward) -> None:
        if self.name is None:
            self.holder.cell_contents = forward
        else:
            setattr(self.holder, self.name, forward)


def _closure_cell(function, name: str):
    code = getattr(function, "__code__", None)
    if code is None or function.__closure__ is None or name not in code.co_freevars:
        return None
    return function.__closure__[code.co_freevars.index(name)]


def _inner_slot(module: torch.nn.Module, wrapper) -> Optional[_Slot]:
    """The slot holding the forward that ``wrapper`` (``module``'s instance forward) calls,
    for the wrappers known here; None for any other."""
    if isinstance(wrapper, functools.partial) and wrapper.args[:1] == (module,):
        # diffusers' HookRegistry: partial(new_forward, module); new_forward's closure holds
        # the hook's HookFunctionReference, whose original_forward (hooks with their own
        # new_forward) or forward is the forward it wrapped.
        cell = _closure_cell(wrapper.func, "function_reference")
        reference = None if cell is None else cell.cell_contents
        if reference is not None and hasattr(reference, "original_forward") and hasattr(reference, "forward"):
            return _Slot(reference, "forward" if reference.original_forward is None else "original_forward")
        # accelerate's add_hook_to_module: partial(new_forward, module) calling module._old_forward
        if (getattr(wrapper.func, "__qualname__", "").startswith("add_hook_to_module.")
                and "_old_forward" in vars(module)):
            return _Slot(module, "_old_forward")
        return None
    # transformers' parallel styles (TensorParallelLayer.install_forward): a closure calling
    # `original_forward`
    cell = _closure_cell(wrapper, "original_forward")
    if cell is not None and callable(cell.cell_contents):
        return _Slot(cell)
    return None


def _wrapper_chain(module: torch.nn.Module, action: str) -> list:
    """The slots of the wrappers around ``module``'s own forward, outermost first (empty
    when its instance forward is its own: none, or a method bound to it). A wrapper this
    module cannot see into is refused: ``action`` would drop it."""
    chain = []
    forward = vars(module).get("forward")
    while forward is not None and not (isinstance(forward, MethodType) and forward.__self__ is module):
        slot = _inner_slot(module, forward)
        if slot is None or len(chain) > 64:
            raise ValueError(
                f"{type(module).__name__} runs a forward another library installed on the module ({forward!r}), "
                f"which ltx-kernels cannot see into and {action or 'kernelize'} would drop: "
                + ("unkernelize before installing it, or remove it first" if action == "unkernelize" else
                   "kernelize the model before installing it (before enable_parallelism(), tensor or sequence "
                   "parallel styles, cache hooks)"))
        chain.append(slot)
        forward = slot.get()
    return chain


def _wrapper_chains(model: torch.nn.Module, action: str) -> Dict[int, tuple]:
    """(module, outermost wrapper, innermost slot) per hooked module of ``model`` that runs
    inside other libraries' wrappers; refuses (ValueError) before anything changes when
    one of them is a wrapper this module cannot see into."""
    chains = {}
    for module in _hooked(model):
        chain = _wrapper_chain(module, action)
        if chain:
            chains[id(module)] = (module, vars(module)["forward"], chain[-1])
    return chains


@contextlib.contextmanager
def _wrappers_set_aside(model: torch.nn.Module, action: str):
    """Inside: each hooked module of ``model`` that runs inside other libraries' wrappers has
    its own forward back as its instance forward (a bound method, or none for its class's),
    as kernelize expects. After: the wrappers are its instance forward again, around its
    new own forward."""
    chains = _wrapper_chains(model, action)
    for module, _, slot in chains.values():
        vars(module)["forward"] = slot.get()
    try:
        yield
    finally:
        for module, outermost, slot in chains.values():
            own = vars(module).pop("forward", None)
            if not (isinstance(own, MethodType) and own.__self__ is module):
                own = MethodType(type(module).forward, module)
            slot.set(own)
            vars(module)["forward"] = outermost


# (host class, layer forward) -> the subclass that runs it, one per pair in the process.
_LAYER_CLASSES: Dict[tuple, type] = {}


def _forwards_into_classes(model: torch.nn.Module) -> None:
    """Move each forward kernelize bound to a module instance into the module's class: a
    subclass of the host's class whose ``forward`` is the layer's (kernelize's own fallback
    to the class's forward is dropped). For a module with a forward in its instance dict,
    dynamo traces ``Module.__call__`` and guards the module's four hook dicts (and the
    bound function); for a class forward it calls ``forward`` directly, and the GPU does
    not wait on those guards at the start of every compiled forward. The subclass keeps
    the host's name and module, so `isinstance` checks and diffusers' class-name lists
    hold; a whole-model pickle cannot name it (save the state dict, as diffusers does).

    Left as kernelize binds them: forwards of layers that do not reach their host through
    ``_host`` (a build older than this, which would call itself), forwards that are not a
    layer's (a hook library's), and modules whose class is not the one its module names
    (a class another library made for the instance, e.g. parametrize's or FSDP's, which
    expects to stay the instance's class)."""
    for module in _hooked(model):
        bound = vars(module).get("forward")
        if not isinstance(bound, MethodType) or bound.__self__ is not module:
            continue
        host, func = type(module), bound.__func__
        if func is host.forward:
            del module.forward
            continue
        layers_module = sys.modules.get(func.__module__)
        if not hasattr(layers_module, "_host") or not _importable(host):
            continue
        key = (host, func)
        if key not in _LAYER_CLASSES:
            _LAYER_CLASSES[key] = type(host.__name__, (host,), {
                "forward": func, "_ltx_host": host, "__module__": host.__module__,
                "__qualname__": host.__qualname__, "__doc__": host.__doc__})
            _share_block_metadata(host, _LAYER_CLASSES[key])
        del module.forward
        module.__class__ = _LAYER_CLASSES[key]


def _share_block_metadata(host: type, layer_class: type) -> None:
    """diffusers' cache hooks (First-Block-Cache, MagCache, SeaCache, layer skipping) look a
    block's class up in its TransformerBlockRegistry and refuse a class it lacks: the layer
    subclass gets a copy of the host's entry (its forward has the host's signature)."""
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry

        metadata = TransformerBlockRegistry.get(host)
    except (ImportError, AttributeError, ValueError):
        return  # not a diffusers class, or a diffusers without this registry
    TransformerBlockRegistry.register(layer_class, dataclasses.replace(metadata, _cls=None,
                                                                       _cached_parameter_indices=None))


def _class_back(module: torch.nn.Module) -> bool:
    """A module `_forwards_into_classes` gave a layer subclass back to its host class;
    False for any other module (left as it is)."""
    cls = type(module)
    if "_ltx_host" not in vars(cls):
        return False
    module.__class__ = cls._ltx_host
    return True


def _classes_back(model: torch.nn.Module) -> None:
    """Every module of ``model`` in a layer subclass back to its host class."""
    for module in _hooked(model):
        _class_back(module)


def _importable(cls: type) -> bool:
    """``cls`` is what its module names it: not a class made at run time."""
    return getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls


# Where kernels logs "No kernel mapping found": kernels.layer.layer up to 0.18,
# kernels._internals.layer.layer since 0.19.
_KERNELS_LAYER_LOGGERS = ("kernels.layer.layer", "kernels._internals.layer.layer")


@contextlib.contextmanager
def _quiet_unmapped_hooks():
    """kernels warns once per module about every hook the mapping lacks (transformers hooks
    SiLU, MLPs, ...): those keep their stock forward, which is the point of our mapping."""
    import kernels

    loggers = [logging.getLogger(name) for name in {*_KERNELS_LAYER_LOGGERS, kernels.LayerRepository.__module__}]
    unmapped = _MessageFilter("No kernel mapping found for layer")
    for logger in loggers:
        logger.addFilter(unmapped)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(unmapped)


class _MessageFilter(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _tag(classes: Dict[str, str], conditions: Optional[dict] = None) -> None:
    from kernels import replace_kernel_forward_from_hub

    for path, hook in classes.items():
        module_name, class_name = path.split(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # an older or newer library without this class: nothing of it to replace
        replace_kernel_forward_from_hub(cls, hook, (conditions or {}).get(class_name))


def _check_ready(model: torch.nn.Module, device: Optional[str], name: str) -> str:
    """The device type to kernelize ``model`` for, or a ValueError saying what to fix."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name} is a {type(model).__name__}, not a torch.nn.Module")
    offload = sorted({hook for m in model.modules() for hook in _offload_hooks(m)})
    if offload:
        raise ValueError(f"{name} ({type(model).__name__}) already has offload hooks ({', '.join(offload)}): "
                         "kernelize after .to(device) and before enable_model_cpu_offload() / "
                         "enable_sequential_cpu_offload() / enable_group_offload()")
    types = sorted({p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()})
    if "meta" in types:
        raise ValueError(f"{name} ({type(model).__name__}) has parameters on the meta device: load its weights "
                         "first")
    if len(types) > 1:
        raise ValueError(f"{name} ({type(model).__name__}) has parameters on {' and '.join(types)}: move it to one "
                         "device first (model.to(device))")
    if device is not None:
        device = torch.device(device).type
        if types and types != [device]:
            raise ValueError(f"{name} ({type(model).__name__}) is on {types[0]}, not {device}: call .to({device!r}) "
                             "before kernelizing")
        return device
    if not types:
        raise ValueError(f"{name} ({type(model).__name__}) has no parameters to tell its device: pass device=")
    if types[0] not in DEVICES:
        raise ValueError(f"{name} ({type(model).__name__}) is on {types[0]}; ltx-kernels runs on "
                         f"{' and '.join(DEVICES)}")
    return types[0]


def _offload_hooks(module: torch.nn.Module) -> Iterator[str]:
    """Names of offload hooks on ``module``: accelerate's (enable_model_cpu_offload,
    enable_sequential_cpu_offload, device_map with offload) and diffusers' group offload."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        if type(h).__name__ == "CpuOffload" or getattr(h, "offload", False):
            yield f"accelerate {type(h).__name__}"
    registry = getattr(module, "_diffusers_hook", None)
    for hook_name in getattr(registry, "hooks", {}):
        if "offload" in hook_name:
            yield f"diffusers {hook_name}"


def _diffusers_models(pipeline_or_model) -> Dict[str, torch.nn.Module]:
    if isinstance(pipeline_or_model, torch.nn.Module):
        return {"model": pipeline_or_model}
    components = getattr(pipeline_or_model, "components", None)
    if not isinstance(components, dict):
        raise TypeError(f"expected a diffusers pipeline or model, got {type(pipeline_or_model).__name__}")
    models = {name: components[name] for name in DIFFUSERS_COMPONENTS
              if isinstance(components.get(name), torch.nn.Module)}
    if not models:
        raise ValueError(f"{type(pipeline_or_model).__name__} has none of the components ltx-kernels kernelizes "
                         f"({', '.join(DIFFUSERS_COMPONENTS)}); pass a model instead")
    return models


@functools.lru_cache(maxsize=None)
def _shared_function_wrappers() -> bool:
    """kernels attaches a hooked function's own wrapper to every module (0.17), not a
    wrapper of the module's own (>= 0.18)."""
    from kernels import use_kernel_forward_from_hub, use_kernelized_func

    probe, module = _probe_hooks(use_kernel_forward_from_hub, use_kernelized_func)
    return any(wrapper is probe for wrapper in module._kernel_funcs.values())


def _probe_hooks(use_kernel_forward_from_hub, use_kernelized_func):
    """A function hooked with the first decorator and a module of a class it is attached
    to with the second: what these decorators make of a model file's functions."""

    @use_kernel_forward_from_hub("LtxKernelsProbe")
    def probe(x):
        return x

    @use_kernelized_func(probe)
    class Probe(torch.nn.Module):
        pass

    return probe, Probe()


def _relink_copied_functions(model: torch.nn.Module) -> None:
    """With kernels 0.17 (one wrapper per model file), ``copy.deepcopy(model)`` copies the
    wrappers in ``_kernel_funcs`` too, while the model's code still calls its model file's
    own: point ``_kernel_funcs`` back at the wrapper that runs, so that kernelize replaces
    it. kernels >= 0.18 routes the model file's calls to the module's own (copied) wrapper:
    nothing to do."""
    if not _shared_function_wrappers():
        return
    for module in model.modules():
        functions = getattr(module, "_kernel_funcs", None)
        if not functions:
            continue
        module_globals = vars(sys.modules[type(module).__module__]).values()
        for key, function in functions.items():
            called = [g for g in module_globals if type(g) is type(function)]
            if len(called) == 1:
                functions[key] = called[0]


def _keep_only_matching_rotary(model: torch.nn.Module) -> None:
    """Put back the stock forward of every replaced ``apply_rotary_pos_emb`` whose result
    differs from the layer's on a probe: model files may share the hook's name and
    signature with other math (nanochat's rotation has the opposite sign, gpt-oss takes
    half-width tables). One probe per wrapper class and layer."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 3, 8, generator=generator), torch.randn(2, 2, 3, 8, generator=generator)
    angles = torch.rand(2, 3, 4, generator=generator) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    verdicts: Dict[tuple, bool] = {}
    for function in (m for m in _hooked(model) if type(m).kernel_layer_name == "rotary_pos_emb"):
        forward = _running_forward(function)
        if forward is type(function).forward:
            continue
        key = (type(function), forward)
        if key not in verdicts:
            try:
                expected = type(function).forward(function, q, k, cos, sin)
                actual = function(q, k, cos, sin)
                verdicts[key] = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(actual, expected))
            except (RuntimeError, ValueError, TypeError) as error:
                logging.getLogger(__name__).info("stock apply_rotary_pos_emb rejects the probe: %s", error)
                verdicts[key] = False
        if not verdicts[key]:
            vars(function).pop("forward", None)
            vars(function).pop("_kernel_repo", None)


# Conditions for the diffusers classes: configurations the layers fuse. Anything else keeps
# its stock forward (and is not counted).


def _norm_without_affine(norm: torch.nn.Module) -> bool:
    from diffusers.models.normalization import RMSNorm

    return (isinstance(norm, (torch.nn.LayerNorm, RMSNorm)) and getattr(norm, "weight", None) is None
            and getattr(norm, "bias", None) is None)


def _ltx_block_fusable(block) -> bool:
    return (_norm_without_affine(block.norm1) and _norm_without_affine(block.norm2)
            and block.scale_shift_table.shape[0] == 6)


def _ltx_attention_fusable(attention) -> bool:
    from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

    return (type(attention.processor) is LTXVideoAttnProcessor and attention.norm_q.weight is not None
            and attention.norm_k.weight is not None)


def _ltx_rope_fusable(rope) -> bool:
    """diffusers' own grid and forward: a subclass that changes either (per-entry offsets,
    say) could give batch entries different tables, which the layer assumes equal."""
    from diffusers.models.transformers.transformer_ltx import LTXVideoRotaryPosEmbed

    host = _host(rope)
    return (host.forward is LTXVideoRotaryPosEmbed.forward
            and host._prepare_video_coords is LTXVideoRotaryPosEmbed._prepare_video_coords)


def _fp8_feed_forward_fusable(ff: torch.nn.Module) -> bool:
    """A feed-forward of FP8 projections (kernelize_diffusers(fp8=True) converts them
    first) that the FeedForward layer computes; 16-bit ones stay stock."""
    return any(isinstance(m, FP8Linear) for m in ff.modules()) and layers._fp8_feed_forward(ff) is not None


_DIFFUSERS_CONDITIONS = {
    "RMSNorm": lambda norm: norm.bias is None,
    "AdaLayerNormZero": lambda ada: _norm_without_affine(ada.norm),
    "AdaLayerNormZeroSingle": lambda ada: _norm_without_affine(ada.norm),
    "AdaLayerNormContinuous": lambda ada: _norm_without_affine(ada.norm),
    "LTXVideoTransformerBlock": _ltx_block_fusable,
    "LTXAttention": _ltx_attention_fusable,
    "LTXVideoRotaryPosEmbed": _ltx_rope_fusable,
    "FeedForward": _fp8_feed_forward_fusable,
}
