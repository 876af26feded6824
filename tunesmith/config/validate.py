"""Check a whole config before anything is built, reporting every problem at once.

:func:`validate_config` walks every mapping and list. For each node with a ``_component_`` it
checks that the path is allowed and imports (suggesting the closest name), that every key is
a parameter of the callable (suggesting the closest parameter) unless it takes ``**kwargs``,
that required parameters are present, and that values fit plain ``int``/``float``/``bool``/
``str`` annotations (and ``Optional``/unions of those; ``Tensor`` members are ignored since a
YAML value never is one). Containers a resolver makes (``${oc.create:{_component_: ...}}`` as a
value, an argument or a list item) are walked where they are used, under that dotted path.
Everywhere it reports interpolations that do not resolve (missing
target, circular reference) and missing ``???`` values (once: not again at every
interpolation that refers to one), and (unless any component is allowed)
``trust_remote_code`` other than false / ``weights_only`` other than true, at any depth and on
the resolved value, which ``instantiate`` refuses too. A
component path is resolved by :func:`resolve_component`, the very check ``instantiate`` makes,
so ``tunesmith validate`` refuses exactly what ``tunesmith run`` would.

Arguments the recipe supplies itself are declared by dotted node path:

- ``runtime_args={"optimizer": 1}``: the recipe calls ``instantiate(cfg.optimizer, params)``,
  so the first positional parameter is supplied at runtime (and must not be in the config);
- ``runtime_kwargs={"loss": ["ignore_index"]}``: keyword arguments the recipe passes, so
  they count as present (a config value for them is allowed and gets overridden).

:func:`check_keys` lets a recipe report unknown or missing keys of its own plain sections.

Example::

    >>> cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "lrr": 0.1}})
    >>> for issue in validate_config(cfg, runtime_args={"optimizer": 1}):
    ...     print(issue)
    optimizer.lrr: unknown argument of torch.optim.AdamW; did you mean 'lr'?
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationToMissingValueError

from tunesmith.config.components import (
    ALLOW_ANY_COMPONENT_ENV,
    COMPONENT_KEY,
    any_component_allowed,
    resolve_component,
    unsafe_argument,
)
from tunesmith.config.errors import ConfigError, ConfigIssue, join_path, suggestion
from tunesmith.config.nodes import MISSING_VALUE, has_key, is_tree_node, read_child
from tunesmith.config.typecheck import type_problem

__all__ = ["check_keys", "validate_config"]

_P = inspect.Parameter
_BY_KEYWORD = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
# The node an interpolation met as ``???``, as omegaconf names it in its message.
_MISSING_TARGET = re.compile(r"Missing mandatory value: ([\w.\[\]]+)")


def validate_config(
    cfg: DictConfig | ListConfig,
    runtime_args: Mapping[str, int] | None = None,
    runtime_kwargs: Mapping[str, Sequence[str]] | None = None,
    *,
    allow_any_component: bool | None = None,
    keys: Sequence[str] | None = None,
    files: bool = True,
) -> list[ConfigIssue]:
    """Every problem found in ``cfg``, in tree order (empty when the config is sound).

    ``runtime_args`` / ``runtime_kwargs`` are keyed by the dotted path of component nodes
    (see the module docstring). ``allow_any_component`` as in :func:`instantiate`. ``keys``:
    check only these top-level keys (what a command builds, e.g. ``tunesmith data preview``'s
    tokenizer and dataset), and the ``???`` values they refer to. ``files=False``: leave out
    the checks that look for the files and folders a config names (a config checked before
    its inputs exist).

    >>> cfg = OmegaConf.create({"model_dir": "???", "tok": {"folder": "${model_dir}"}, "x": "${y}"})
    >>> [str(issue) for issue in validate_config(cfg, keys=["tok"])]  # not x
    ['model_dir: value is missing (???); set it in the config or with an override']
    """
    walker = _Walker(
        dict(runtime_args or {}), dict(runtime_kwargs or {}), allow_any_component, files
    )
    if keys is None:
        walker.node(cfg, "")
    else:
        for key in keys:
            if isinstance(cfg, DictConfig) and has_key(cfg, key):
                walker.child(cfg, key, "")
    reported = {issue.path for issue in walker.issues}
    walker.issues += [
        ConfigIssue(path, MISSING_VALUE)
        for path in dict.fromkeys(walker.missing_targets)
        if path not in reported
    ]
    if keys is not None:  # in the config's order, as a walk of the whole tree reports them
        order = {str(key): index for index, key in enumerate(cfg.keys())}
        walker.issues.sort(key=lambda issue: order.get(issue.path.split(".")[0], len(order)))
    return walker.issues


def check_keys(
    node: Mapping[str, Any] | DictConfig,
    allowed: Iterable[str],
    path: str = "",
    required: Iterable[str] = (),
) -> list[ConfigIssue]:
    """Issues for keys of ``node`` not in ``allowed`` (closest allowed key suggested) and for
    ``required`` keys that are absent. ``path`` is the node's dotted path, used in the issues.

    >>> for issue in check_keys({"bach_size": 8}, ["epochs", "batch_size"], required=["seed"]):
    ...     print(issue)
    bach_size: unknown key; did you mean 'batch_size'?
    seed: required key is missing
    """
    allowed = list(allowed)
    keys = list(node.keys())
    issues = [
        ConfigIssue(join_path(path, key), "unknown key" + _hint_or_list(str(key), allowed))
        for key in keys
        if key not in allowed
    ]
    issues += [
        ConfigIssue(join_path(path, key), "required key is missing")
        for key in required
        if key not in keys
    ]
    return issues


def _hint_or_list(name: str, allowed: list[str]) -> str:
    hint = suggestion(name, allowed)
    if hint or not allowed:
        return hint
    shown = ", ".join(sorted(allowed)[:12]) + (", ..." if len(allowed) > 12 else "")
    return f"; allowed keys: {shown}"


class _Walker:
    def __init__(
        self,
        runtime_args: dict[str, int],
        runtime_kwargs: dict[str, Sequence[str]],
        allow_any: bool | None,
        files: bool,
    ) -> None:
        self.runtime_args = runtime_args
        self.files = files
        self.runtime_kwargs = runtime_kwargs
        self.allow_any = allow_any
        self.issues: list[ConfigIssue] = []
        self.missing_targets: list[str] = []  # `???` values interpolations met, by path

    def add(self, path: str, message: str) -> None:
        self.issues.append(ConfigIssue(path, message))

    def node(self, node: DictConfig | ListConfig, path: str) -> None:
        if isinstance(node, DictConfig) and has_key(node, COMPONENT_KEY):
            self.component(node, path)
        elif isinstance(node, DictConfig):
            for key in node:
                self.child(node, key, path)
        elif isinstance(node, ListConfig):
            for index in range(len(node)):
                self.child(node, index, path)

    def child(self, parent: DictConfig | ListConfig, key: Any, path: str) -> tuple[bool, Any]:
        """Read (and descend into) ``parent[key]``; returns (readable, value)."""
        child_path = join_path(path, key)
        try:
            value = read_child(parent, key, child_path)
        except ConfigError as exc:
            # `${model_dir}` while model_dir is `???`: the `???` is reported where it is
            if not isinstance(exc.__cause__, InterpolationToMissingValueError):
                self.add(child_path, exc.message)
            elif found := _MISSING_TARGET.search(str(exc.__cause__)):
                self.missing_targets.append(found.group(1))
            else:
                self.add(child_path, exc.message)
            return False, None
        reason = unsafe_argument(key, value)
        if reason is not None and not any_component_allowed(self.allow_any):
            hint = f"(--allow-any-component, or {ALLOW_ANY_COMPONENT_ENV}=1)"
            self.add(child_path, f"{reason}; refused unless any component is allowed {hint}")
        # A reference to another node of the tree is validated where that node is defined; a
        # container a resolver made (`${oc.create:{...}}`) exists only here: validated here.
        if isinstance(value, (DictConfig, ListConfig)) and not (
            OmegaConf.is_interpolation(parent, key) and is_tree_node(value)
        ):
            self.node(value, child_path)
        return True, value

    def component(self, node: DictConfig, path: str) -> None:
        component_path = join_path(path, COMPONENT_KEY)
        target: Callable[..., Any] | None = None
        spec: Any = None
        try:
            spec = read_child(node, COMPONENT_KEY, component_path)
            target = resolve_component(spec, allow_any_component=self.allow_any)
        except ConfigError as exc:
            self.add(component_path, exc.message)
        values: dict[str, tuple[bool, Any]] = {}
        for key in node:
            if key == COMPONENT_KEY:
                continue
            if isinstance(key, str) and len(key) > 2 and key[0] == key[-1] == "_":
                self.add(
                    join_path(path, key),
                    "unknown special key; only '_component_' is special"
                    + suggestion(key, [COMPONENT_KEY]),
                )
            values[str(key)] = self.child(node, key, path)
        if target is not None:
            self.arguments(target, str(spec), values, path)

    def arguments(
        self,
        target: Callable[..., Any],
        name: str,
        values: dict[str, tuple[bool, Any]],
        path: str,
    ) -> None:
        signature = _signature(target)
        if signature is None:
            return  # a builtin without an inspectable signature: nothing to check against
        params = signature.parameters
        kinds = {p.kind for p in params.values()}
        positional = [p for p in params.values() if p.kind in _POSITIONAL]
        n_runtime = self.runtime_args.get(path, 0)
        if n_runtime > len(positional) and _P.VAR_POSITIONAL not in kinds:
            self.add(
                path,
                f"{name} takes {len(positional)} positional argument(s) but the recipe "
                f"passes {n_runtime} at runtime",
            )
        passed_positionally = {p.name for p in positional[:n_runtime]}
        passed_by_keyword = set(self.runtime_kwargs.get(path, ()))
        accepted = [p.name for p in params.values() if p.kind in _BY_KEYWORD]
        for key, (readable, value) in values.items():
            key_path = join_path(path, key)
            param = params.get(key)
            if key in passed_positionally:
                self.add(
                    key_path,
                    f"the recipe passes this argument of {name} at runtime; remove it from "
                    "the config",
                )
            elif param is None or param.kind not in _BY_KEYWORD:
                if _P.VAR_KEYWORD in kinds and (param is None or param.kind != _P.POSITIONAL_ONLY):
                    continue
                if param is not None and param.kind == _P.POSITIONAL_ONLY:
                    self.add(key_path, f"is a positional-only parameter of {name}")
                elif not (key.startswith("_") and key.endswith("_")):
                    self.add(key_path, f"unknown argument of {name}" + suggestion(key, accepted))
            elif readable:
                problem = type_problem(param.annotation, value, files=self.files)
                if problem:
                    self.add(key_path, f"{problem} (argument of {name})")
        for param in params.values():
            if param.default is not _P.empty or param.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
                continue
            if param.name in values or param.name in passed_positionally:
                continue
            if param.name in passed_by_keyword and param.kind != _P.POSITIONAL_ONLY:
                continue
            message = f"missing required argument of {name}"
            if param.kind == _P.POSITIONAL_ONLY:
                message += " (positional-only: the recipe must pass it at runtime)"
            self.add(join_path(path, param.name), message)


def _signature(target: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(target, eval_str=True)
    except ValueError:
        return None  # no signature to inspect (some builtins and C types)
    except Exception:
        pass  # an annotation names something not importable here (TYPE_CHECKING): see below
    try:
        signature = inspect.signature(target)
    except (ValueError, TypeError):
        return None
    return signature.replace(
        parameters=[
            p.replace(annotation=_evaluated(p.annotation, target))
            for p in signature.parameters.values()
        ]
    )


def _evaluated(annotation: Any, target: Callable[..., Any]) -> Any:
    """A postponed (text) annotation evaluated in the module of ``target``, one at a time:
    ``source: DataSource`` is checked even when ``tokenizer: Tokenizer`` names a class only
    imported for type checkers; one that does not evaluate stays text."""
    module = sys.modules.get(str(getattr(target, "__module__", "")))
    if not isinstance(annotation, str) or module is None:
        return annotation
    try:
        return eval(annotation, dict(vars(module)))  # noqa: S307 - the component's source text
    except Exception:
        return annotation
