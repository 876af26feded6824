"""Resolve ``_component_`` dotted paths to callables, behind an allow-list.

A config names what to build by a dotted path (``torch.optim.AdamW``). Resolving one imports
its module, which runs code, so unless the caller allows any component
(``allow_any_component=True``, or the environment variable ``TUNESMITH_ALLOW_ANY_COMPONENT=1``,
which ``--allow-any-component`` on the command line sets so that it also reaches processes
started by torchrun) a path is resolved under these rules:

- the module imported first must lie in a package of :data:`ALLOWED_COMPONENT_PREFIXES`,
  checked on the name before anything is imported;
- no part of the path may start with ``_`` (private names and ``__globals__``-like ones);
- what the path resolves to, when it is defined in tunesmith or in another package of the list
  that is not one of the :data:`CHECKED_LIBRARIES` (a user's own ``mylab.``), must carry the
  positive mark :func:`tunesmith.config.registry.component` itself: a package's helpers and
  code runners (the CodeTests sandbox runner) are never built from a config;
- a plain function or method descriptor reached through a class (``CodeTests.score``,
  ``torch.nn.Module.register_forward_hook``: an unbound method, which a ``self:`` argument would
  call on an object of the config's choosing) is refused unless that function is marked; a
  classmethod bound to its class (``transformers.AutoModel.from_pretrained``) is not unbound;
- every hop of the chain is judged by what it *is*, not by how it was reached: a module by its
  ``__name__``, a function by the module whose globals it runs in (and what it wraps), a class
  by its defining module and qualified name, a bound method by its function and owner, any
  other object by its type. Each must lie in an allowed package and not under
  :data:`DENIED_COMPONENTS` (loaders of pickles/TorchScript/hub code, functions that run code
  or commands), so ``torch.os.system`` (the module ``os``) or
  ``torch.optim.optimizer.torch.load`` (``torch.serialization.load``) are refused wherever
  they are re-exported.

Example::

    >>> resolve_component("torch.nn.Linear")
    <class 'torch.nn.modules.linear.Linear'>
    >>> resolve_component("torch.os.system")
    Traceback (most recent call last):
    ...
    tunesmith.config.errors.ConfigError: component 'torch.os.system' is not allowed: \
'torch.os' is the module 'os', outside the allowed packages (...); to allow any component ...
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import re
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from tunesmith.config.errors import ConfigError, did_you_mean, join_path, type_name
from tunesmith.config.registry import is_marked

__all__ = [
    "ALLOWED_COMPONENT_PREFIXES",
    "ALLOW_ANY_COMPONENT_ENV",
    "CHECKED_LIBRARIES",
    "COMPONENT_KEY",
    "DENIED_COMPONENTS",
    "any_component_allowed",
    "component_refusal",
    "is_component_allowed",
    "resolve_component",
    "unsafe_argument",
    "unsafe_arguments",
]

COMPONENT_KEY = "_component_"

# Packages whose components may be resolved without opting in. Extend it in place
# (``ALLOWED_COMPONENT_PREFIXES.append("mylab.")``) to trust another package.
ALLOWED_COMPONENT_PREFIXES: list[str] = [
    "tunesmith.",
    "torch.",
    "torchao.",
    "bitsandbytes.",
    "transformers.",
    "peft.",
    "datasets.",
]

# The libraries of the list whose objects are judged by what each hop is (and the deny-list)
# and need no mark; in every other allowed package (tunesmith's own, a user's) only objects
# marked with ``@component`` (tunesmith.config.registry) are built.
CHECKED_LIBRARIES: tuple[str, ...] = (
    "torch.",
    "torchao.",
    "bitsandbytes.",
    "transformers.",
    "peft.",
    "datasets.",
)

# What a path may not resolve to even inside the allowed packages: a module (and everything
# defined in it) or a ``module.QualifiedName``. Matched against where an object is *defined*,
# so re-exports (``torch.load`` is ``torch.serialization.load``) are caught too.
DENIED_COMPONENTS: list[str] = [
    # loaders of pickles, TorchScript, packages, hub repos, shared libraries
    "torch.serialization",  # torch.load, add_safe_globals
    "torch.storage._load_from_bytes",
    "torch.hub",
    "torch.jit",  # load, _serialization, CompilationUnit (re-exported from torch._C)
    "torch._C.CompilationUnit",
    "torch._C.import_ir_module",
    "torch._C.import_ir_module_from_buffer",
    "torch.package",
    "torch.utils.model_zoo",
    "torch.utils.cpp_extension",
    "torch.utils.model_dump",
    "torch.utils.show_pickle",
    "torch.utils._content_store",
    "torch.utils._config_module",  # config load_config unpickles
    "torch.utils.data.datapipes",  # decoders unpickle, dill
    "torch._utils",  # _import_dotted_name, snapshot pickle loads
    "torch._ops._Ops.load_library",  # torch.ops.load_library: dlopen
    "torch._ops._Ops.import_module",
    "torch._classes._Classes.load_library",
    "torch.cuda.memory.CUDAPluggableAllocator",  # dlopen
    "torch.xpu.memory.XPUPluggableAllocator",
    "torch.cuda.jiterator",
    "torch.distributed.checkpoint",  # dcp.load, format_utils: unpickle
    "torch.distributed.rpc",
    "torch.distributed.elastic",  # launches processes, pickled rendezvous state
    "torch.distributed.run",  # torchrun: runs a script
    "torch.distributed.launch",
    "torch.distributed.launcher",
    "torch.distributed.flight_recorder",
    "torch.distributed._tools",
    "torch.distributed.nn.jit",  # writes and execs generated code
    "torch.distributed.nn.api.remote_module",
    "torch.distributed.optim.zero_redundancy_optimizer._broadcast_object",
    *(
        f"torch.distributed.distributed_c10d.{name}"  # they unpickle what they receive
        for name in (
            "_object_to_tensor",
            "_tensor_to_object",
            "all_gather_object",
            "broadcast_object_list",
            "gather_object",
            "recv_object_list",
            "scatter_object_list",
            "send_object_list",
        )
    ),
    "torch.multiprocessing",
    # compilers and code generators that exec source text or run commands
    "torch._dynamo",
    "torch._inductor",
    "torch._functorch",
    "torch._export",
    "torch.export",
    "torch._higher_order_ops",
    "torch._guards",
    "torch._vendor",
    "torch._strobelight",
    "torch.compiler",  # load_cache_artifacts
    "torch.fx",  # graph_module exec, experimental.rewriter
    "torch.onnx",
    "torch.utils.benchmark",
    "torch.utils.collect_env",  # run(command): a shell
    "torch.utils._get_clean_triton",
    "torch.utils._strobelight",
    "torch.utils._pytree",  # imports modules named in serialized specs
    "torch.utils.pytree",
    "torch.backends.xeon",  # run_cpu launches a program
    "torch.cuda._memory_viz",
    "torch.testing._internal",
    # transformers, datasets, peft, torchao, bitsandbytes
    "transformers.dynamic_module_utils",
    "transformers.utils.import_utils",  # direct_transformers_import(path) runs a file
    "transformers.testing_utils",
    "transformers.cli",
    "transformers.commands",
    "transformers.pipelines.audio_utils",  # ffmpeg with caller-given arguments
    "transformers.integrations.hub_kernels",  # downloads and loads kernels
    "transformers.models.rag.retrieval_rag",  # pickled index
    "datasets.load.import_main_class",
    "datasets.streaming.extend_module_for_streaming",
    "datasets.utils.patching",
    "peft.tuners.lora.tp_layer",  # imports the module its config names
    "torchao.kernel.autotuner",  # pickled cache
    "torchao.experimental.ops.mps.utils",  # torch.ops.load_library
    "torchao.prototype.spinquant",
    "torchao.prototype.quantization.mixed_precision.scripts",
    "torchao.prototype.gptq.gptq_example",
    "bitsandbytes.utils.execute_and_return",  # runs a command string
    "bitsandbytes.cextension",  # dlopen
    "bitsandbytes.diagnostics",
    "bitsandbytes.__main__",
    # tunesmith's own entry points: they run (or resolve) other configs and recipes. The mark
    # already refuses anything unmarked; these stay as a second fence (a mark put there by
    # mistake is still refused).
    "tunesmith.cli",
    "tunesmith.config",
    "tunesmith.recipes",
    "tunesmith.demo",
    "tunesmith.training.loop.run_main",
]

ALLOW_ANY_COMPONENT_ENV = "TUNESMITH_ALLOW_ANY_COMPONENT"

_DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
# Decorator modules whose wrappers are judged by what they wrap (``__wrapped__``).
_WRAPPER_MODULES = ("functools", "typing_extensions", "typing", "warnings", "contextlib")
_DESCRIPTORS = (
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.ClassMethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
)
_WHY_DENIED = "loads pickles, TorchScript or downloaded code, or runs code or commands"
_UNBOUND = (types.FunctionType, *_DESCRIPTORS)
_HOW_TO_MARK = (
    "only callables marked with @tunesmith.config.component are built from a config; for a "
    "package of your own, add its prefix to tunesmith.config.ALLOWED_COMPONENT_PREFIXES and "
    "mark what a config may build"
)


class _Refused(Exception):
    """A hop of a component path resolved outside the allow-list (``args[0]``: why)."""


@dataclass(frozen=True)
class _Origin:
    """Where an object is defined: ``kind`` ('module', 'class', 'function', ...), ``module``
    and ``qualname`` ('' for a module); ``verified`` is False for a class not found where it
    says it is defined."""

    kind: str
    module: str
    qualname: str = ""
    verified: bool = True

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module


def any_component_allowed(allow_any_component: bool | None = None) -> bool:
    """The explicit choice when given, else whether the environment variable is set truthy."""
    if allow_any_component is not None:
        return allow_any_component
    flag = os.environ.get(ALLOW_ANY_COMPONENT_ENV, "").strip().lower()
    return flag in {"1", "true", "yes", "on"}


def component_refusal(path: str) -> str | None:
    """Why ``path`` is refused without ``--allow-any-component`` (None when it resolves to
    allowed objects). Imports only modules of the allowed packages; a path that does not
    resolve raises :class:`ConfigError`.

    >>> component_refusal("torch.os.system")
    "'torch.os' is the module 'os', outside the allowed packages (tunesmith, torch, ...)"
    """
    try:
        _locate(path, checked=True)
    except _Refused as refused:
        return str(refused)
    return None


def is_component_allowed(path: str) -> bool:
    """Whether ``path`` resolves, without ``--allow-any-component``, to an object inside the
    allow-list (False when refused, or when it does not resolve at all).

    >>> is_component_allowed("torch.optim.AdamW"), is_component_allowed("torch.load")
    (True, False)
    """
    try:
        return component_refusal(path) is None
    except ConfigError:
        return False


def resolve_component(
    path: object, *, allow_any_component: bool | None = None
) -> Callable[..., Any]:
    """Import and return the callable at dotted ``path``.

    Raises :class:`ConfigError` (message without the config path; callers add it) when the
    value is not a dotted-path string, is refused by the allow-list (naming the hop and what
    it resolved to), does not import (with the closest existing name suggested), or is not
    callable.
    """
    if not isinstance(path, str):
        raise ConfigError(
            f"_component_ must be a dotted path string such as 'torch.optim.AdamW', "
            f"got {type_name(path)} {_shown(path)}"
        )
    if not _DOTTED_PATH.match(path):
        raise ConfigError(
            f"_component_ {path!r} is not a full dotted path such as 'torch.optim.AdamW'"
        )
    try:
        target = _locate(path, checked=not any_component_allowed(allow_any_component))
    except _Refused as refused:
        raise ConfigError(
            f"component {path!r} is not allowed: {refused}; to allow any component pass "
            "--allow-any-component (allow_any_component=True, or set "
            f"{ALLOW_ANY_COMPONENT_ENV}=1)"
        ) from None
    if not callable(target):
        raise ConfigError(f"component {path!r} is a {type(target).__name__}, not a callable")
    return target


def unsafe_argument(key: object, value: object) -> str | None:
    """Why passing ``key=value`` to a component is refused without the flag (None if fine).
    The safety keywords must be exactly their safe value, or absent: ``trust_remote_code``
    ``False`` and ``weights_only`` ``True`` (``0``, ``[]``, ``""``, ``"false"`` or ``null``
    are not ``True``: torch's own default can be switched off by an environment variable, and
    transformers asks on a terminal when ``trust_remote_code`` is ``None``).

    >>> unsafe_argument("weights_only", False)
    'weights_only=false would unpickle arbitrary objects (and run their code)'
    >>> unsafe_argument("weights_only", 0)
    'weights_only=0 is not true: only true (or leaving it out) is accepted; ...'
    """
    if key == "trust_remote_code" and value is not False:
        if value is True:
            return "trust_remote_code=true would run Python code downloaded with the model"
        return (
            f"trust_remote_code={_shown(value)} is not false: only false (or leaving it out) "
            "is accepted; any other value may run Python code downloaded with the model"
        )
    if key == "weights_only" and value is not True:
        if value is False:
            return "weights_only=false would unpickle arbitrary objects (and run their code)"
        return (
            f"weights_only={_shown(value)} is not true: only true (or leaving it out) is "
            "accepted; any other value may unpickle arbitrary objects (and run their code)"
        )
    return None


def unsafe_arguments(value: object, path: str) -> Iterator[tuple[str, str]]:
    """(dotted path, reason) of every unsafe argument in ``value``, nested mappings and lists
    included (``model_kwargs: {trust_remote_code: true}``).

    >>> list(unsafe_arguments({"kw": {"trust_remote_code": True}}, "model"))
    [('model.kw.trust_remote_code', 'trust_remote_code=true would run Python code ...')]
    """
    if type(value) is dict:  # plain containers only: what config nodes are built into
        items: Iterable[tuple[object, object]] = value.items()
    elif type(value) in (list, tuple):
        items = enumerate(value)  # type: ignore[arg-type]
    elif isinstance(value, (DictConfig, ListConfig)):  # a runtime keyword given as a node
        items = _node_items(value)
    else:
        return
    for key, item in items:
        item_path = join_path(path, key)
        reason = unsafe_argument(key, item)
        if reason is not None:
            yield item_path, reason
        yield from unsafe_arguments(item, item_path)


def _node_items(node: DictConfig | ListConfig) -> Iterator[tuple[object, object]]:
    """``node``'s (key, resolved value) pairs; a value that does not resolve is skipped (it is
    reported where it is read)."""
    keys: Iterable[object] = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        try:
            yield key, node[key]  # type: ignore[index]
        except Exception:
            continue


def _shown(value: object) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        return repr(OmegaConf.to_container(value, resolve=False))
    if value is None:
        return "null"
    return repr(value)


# ----------------------------------------------------------------------------- resolution


def _locate(path: str, *, checked: bool) -> object:
    """The object at ``path``; with ``checked``, every hop judged (raises :class:`_Refused`)."""
    parts = path.split(".")
    if checked:
        _check_names(parts)
    obj, found = _import_longest(path, parts, checked)
    for index in range(found, len(parts)):
        owner, obj = obj, _attribute(obj, parts, index)
        if checked:
            hop = ".".join(parts[: index + 1])
            _judge(hop, obj)
            _check_unbound(hop, owner, obj)
    if checked:
        _check_mark(path, obj)
    return obj


def _check_unbound(hop: str, owner: object, obj: object) -> None:
    """Refuse a plain function or method descriptor taken from a class (an unbound method,
    which a ``self`` argument would call on any object), unless it is marked.

    >>> import torch
    >>> hook = torch.nn.Module.register_forward_hook
    >>> _check_unbound("torch.nn.Module.register_forward_hook", torch.nn.Module, hook)
    Traceback (most recent call last):
    tunesmith.config.components._Refused: 'torch.nn.Module.register_forward_hook' is an unbound ...
    """
    if isinstance(owner, type) and isinstance(obj, _UNBOUND) and not is_marked(obj):
        where = f"{owner.__module__}.{owner.__qualname__}"
        raise _Refused(
            f"{hop!r} is an unbound method of the class {where!r} (a `self` argument would "
            "call it on any object); only a method marked with @tunesmith.config.component is "
            "built through its class"
        )


def _check_mark(path: str, obj: object) -> None:
    """Refuse ``obj`` defined in a package that needs the mark (tunesmith's own, a user's)
    unless it carries it (see :mod:`tunesmith.config.registry`)."""
    if is_marked(obj):
        return
    for origin in _origins(obj):
        if _needs_mark(origin.module):
            raise _Refused(
                f"{path!r} is the {origin.kind} {origin.name!r}, which is not marked as a "
                f"component ({_HOW_TO_MARK})"
            )


def _check_names(parts: list[str]) -> None:
    for index, part in enumerate(parts):
        if part.startswith("_"):
            kind = "special" if part.startswith("__") else "private"
            hop = ".".join(parts[: index + 1])
            raise _Refused(
                f"{hop!r} names the {kind} attribute {part!r} (names starting with '_' are "
                "never resolved)"
            )


def _import_longest(path: str, parts: list[str], checked: bool) -> tuple[ModuleType, int]:
    """Import the longest module prefix of ``path``; with ``checked``, each candidate name is
    checked against the allow-list before it is imported."""
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        if checked:
            _check_module_name(path, module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                continue  # this module (or a parent of it) does not exist: try a shorter one
            raise ConfigError(f"importing {module_name!r} for {path!r} failed: {exc}") from exc
        except Exception as exc:
            raise ConfigError(
                f"importing {module_name!r} for {path!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if checked:
            _judge(module_name, module)
        return module, end
    raise ConfigError(f"component {path!r}: no module named {parts[0]!r}")


def _check_module_name(path: str, module_name: str) -> None:
    if not _in_allowed_package(module_name):
        raise _Refused(f"{path!r} is outside the allowed packages ({_packages()})")
    entry = _denied_entry(module_name)
    if entry is not None:
        raise _Refused(f"{module_name!r} is denied: {_denied_what(module_name, entry)}")


def _attribute(obj: object, parts: list[str], index: int) -> object:
    name, owner = parts[index], ".".join(parts[:index])
    try:
        return getattr(obj, name)
    except AttributeError:
        pass
    except Exception as exc:  # a lazy module whose import fails, a raising property
        raise ConfigError(
            f"component {'.'.join(parts)!r}: getting {name!r} from {owner!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    hint = ""
    best = did_you_mean(name, _public_names(obj))
    if best is not None:
        fixed = ".".join([*parts[:index], best, *parts[index + 1 :]])
        hint = f"; did you mean {fixed!r}?"
    raise ConfigError(f"component {'.'.join(parts)!r}: {owner!r} has no attribute {name!r}{hint}")


def _public_names(obj: object) -> list[str]:
    names = [name for name in dir(obj) if not name.startswith("_")]
    if isinstance(obj, ModuleType) and hasattr(obj, "__path__"):
        names += [info.name for info in pkgutil.iter_modules(obj.__path__)]
    return names


# ----------------------------------------------------------------------------- judging


def _judge(hop: str, obj: object) -> None:
    """Raise :class:`_Refused` unless everything ``obj`` is defined by is allowed.

    >>> import torch
    >>> _judge("torch.os", torch.os)
    Traceback (most recent call last):
    tunesmith.config.components._Refused: 'torch.os' is the module 'os', outside the allowed ...
    """
    origins = _origins(obj)
    if not origins:
        raise _Refused(f"{hop!r} is a {type(obj).__name__} whose origin cannot be checked")
    for origin in origins:
        what = f"{hop!r} is the {origin.kind} {origin.name!r}"
        if not _in_allowed_package(origin.module):
            raise _Refused(f"{what}, outside the allowed packages ({_packages()})")
        entry = _denied_entry(origin.name)
        if entry is not None:
            raise _Refused(f"{what}, denied: {_denied_what(origin.name, entry)}")
        if not origin.verified:
            raise _Refused(f"{what}, but {origin.module!r} does not hold it under that name")


def _origins(obj: object, depth: int = 0) -> list[_Origin]:
    """Where ``obj`` is defined: every origin that must be allowed ([] when unknown).

    >>> import torch
    >>> _origins(torch.load)
    [_Origin(kind='function', module='torch.serialization', qualname='load', verified=True)]
    """
    if depth > 8:
        return []
    if isinstance(obj, ModuleType):
        name = obj.__dict__.get("__name__")
        return [_Origin("module", name)] if isinstance(name, str) else []
    if isinstance(obj, type):
        return [_class_origin(obj)]
    if isinstance(obj, functools.partial):
        return _origins(obj.func, depth + 1)
    if isinstance(obj, types.FunctionType):
        module = obj.__globals__.get("__name__")  # where its code runs: __module__ can lie
        own = _Origin("function", str(module), obj.__qualname__)
        return _with_wrapped(own, obj, depth)
    if isinstance(obj, types.MethodType):
        return [*_origins(obj.__func__, depth + 1), *_owner_origins(obj.__self__)]
    if isinstance(obj, types.BuiltinFunctionType):
        return _builtin_origins(obj)
    if isinstance(obj, _DESCRIPTORS):
        cls = obj.__objclass__
        return [_Origin("method", cls.__module__, f"{cls.__qualname__}.{obj.__name__}")]
    if isinstance(obj, types.MethodWrapperType):
        return _owner_origins(obj.__self__)
    cls = _class_origin(type(obj))
    own = _Origin("instance of", cls.module, cls.qualname, cls.verified)
    return _with_wrapped(own, obj, depth)


def _class_origin(cls: type) -> _Origin:
    module = cls.__dict__.get("__module__", getattr(cls, "__module__", None))
    qualname = getattr(cls, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return _Origin("class", str(module), str(qualname), verified=False)
    return _Origin("class", module, qualname, verified=_holds(module, qualname, cls))


def _holds(module: str, qualname: str, cls: type) -> bool:
    """Whether ``module`` holds ``cls`` at ``qualname`` (or, renamed, at its top level).
    Namespaces are read directly, so no lazy import hook runs."""
    if _defined_at(module, qualname) is cls:
        return True
    namespace = getattr(sys.modules.get(module), "__dict__", {})
    return any(value is cls for value in list(namespace.values()))


def _defined_at(module: str, qualname: str) -> object:
    """What ``module``'s namespace holds at ``qualname``."""
    obj: object = sys.modules.get(module)
    for part in qualname.split("."):
        namespace = getattr(obj, "__dict__", None)
        if part == "<locals>" or not isinstance(namespace, types.MappingProxyType | dict):
            return None
        obj = namespace.get(part)
    return obj


def _owner_origins(owner: object) -> list[_Origin]:
    """The class a method is bound to (``owner`` itself, or the type of an instance)."""
    if isinstance(owner, ModuleType):
        return _origins(owner)
    return [_class_origin(owner if isinstance(owner, type) else type(owner))]


def _builtin_origins(fn: types.BuiltinFunctionType) -> list[_Origin]:
    owner = fn.__self__
    if isinstance(owner, ModuleType):
        return [_Origin("builtin function", str(owner.__dict__.get("__name__")), fn.__name__)]
    if owner is None or type(owner).__module__ == "pybind11_builtins":  # a pybind11 function
        return [_Origin("builtin function", str(fn.__module__), fn.__name__)]
    cls = owner if isinstance(owner, type) else type(owner)
    own = _Origin("builtin method", cls.__module__, f"{cls.__qualname__}.{fn.__name__}")
    return [own, _class_origin(cls)]


def _with_wrapped(own: _Origin, obj: object, depth: int) -> list[_Origin]:
    """``own``, plus the origins of what ``obj`` wraps (``functools.wraps``' ``__wrapped__``);
    a wrapper from a decorator module (functools, typing_extensions...) counts as what it
    wraps."""
    try:
        wrapped = vars(obj).get("__wrapped__")
    except Exception:  # no __dict__
        wrapped = None
    if wrapped is None:
        return [own]
    inner = _origins(wrapped, depth + 1)
    if own.module in _WRAPPER_MODULES and inner:
        return inner
    return [own, *inner]


# ----------------------------------------------------------------------------- lists


def _prefixes() -> list[str]:
    return [p if p.endswith(".") else p + "." for p in ALLOWED_COMPONENT_PREFIXES]


def _packages() -> str:
    return ", ".join(p.rstrip(".") for p in ALLOWED_COMPONENT_PREFIXES)


def _needs_mark(module: str) -> bool:
    """Whether objects defined in ``module`` are built only when marked: an allowed package
    that is not one of :data:`CHECKED_LIBRARIES` (``tunesmith``, a user's ``mylab``)."""
    checked = any(f"{module}.".startswith(prefix) for prefix in CHECKED_LIBRARIES)
    return _in_allowed_package(module) and not checked


def _in_allowed_package(name: str) -> bool:
    """``name`` (a module or dotted name) lies in an allowed package: ``torch`` and
    ``torch.nn`` do under ``torch.``, ``torchvision`` does not."""
    return any(f"{name}.".startswith(prefix) for prefix in _prefixes())


def _denied_what(name: str, entry: str) -> str:
    """Why ``name`` (under ``entry`` of :data:`DENIED_COMPONENTS`) is denied, in words."""
    return f"it {_WHY_DENIED}" if name == entry else f"{entry!r} {_WHY_DENIED}"


def _denied_entry(name: str) -> str | None:
    """The entry of :data:`DENIED_COMPONENTS` that ``name`` is, or lies under (None if none)."""
    for entry in DENIED_COMPONENTS:
        if name == entry or name.startswith(entry + "."):
            return entry
    return None
