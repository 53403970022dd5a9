"""gin experiment files: the same config tree as a YAML file, written in gin's syntax.

A ``.gin`` file is parsed by gin-config's own parser (its grammar, literals, macros, binding
blocks) and each binding lands on the dotted config key it names, so the result is the same
plain dict a YAML file gives and the same strict builder and :func:`validate` check it::

    experiment.name = 'tiny'            # top-level keys (name, seed) sit under "experiment"
    model.d_model = 32                  # model.d_model: 32
    cluster.chips = {'sim_a': {'nodes': 1}}
    plan.stages = [{'chip': 'sim_a', 'data': 2, 'tensor': 1, 'layers': [0, 2]}]

One binding is gin's own: ``experiment.model = @my_pkg.MyModel`` selects a user's Flax NNX
model class by reference (imported by its dotted path); ``MyModel.width = 48`` binds its
constructor's keyword arguments. ``h2jax train`` builds it as ``MyModel(nnx.Rngs(seed), width=48)``.
Every problem -- a syntax error, an unknown binding, a name that does not import -- is a
:class:`ConfigError` naming the file, the line and the binding.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gin import config_parser

from h2jax._paths import find_experiment
from h2jax.config._errors import ConfigError
from h2jax.config._schema import ExperimentConfig

TOP = "experiment"  # gin bindings need a selector: top-level keys are experiment.name, experiment.seed
SECTIONS = frozenset(f.name for f in dataclasses.fields(ExperimentConfig))


@dataclasses.dataclass(frozen=True)
class _Ref:
    name: str
    evaluate: bool


@dataclasses.dataclass(frozen=True)
class _Macro:
    name: str


class _Delegate(config_parser.ParserDelegate):
    def configurable_reference(self, scoped_configurable_name, evaluate):
        return _Ref(scoped_configurable_name, evaluate)

    def macro(self, macro_name):
        return _Macro(macro_name)


@dataclasses.dataclass(frozen=True)
class GinExperiment:
    """What a gin file says: the raw config dict and, if it names one, the user's model class."""

    raw: dict[str, Any]
    model_class: type | None = None
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def model_factory(self) -> Callable[[Any], Any] | None:
        """``factory(rngs) -> nnx.Module`` building the selected model; None: the built-in model."""
        if self.model_class is None:
            return None
        return functools.partial(self.model_class, **self.model_kwargs)

    def model_description(self) -> str | None:
        """``module.Class(key=value, ...)``: the class and arguments the file selects; None: the built-in model."""
        if self.model_class is None:
            return None
        args = ", ".join(f"{k}={v!r}" for k, v in self.model_kwargs.items())
        return f"{self.model_class.__module__}.{self.model_class.__qualname__}({args})"


def _where(path: Path, loc: Any) -> str:
    return f"{path}:{loc.line_num}"


def _import(path: Path, module: str, key: str, where: str) -> Any:
    # the gin file's folder and the working directory hold a user's own modules, as for `python -m`
    for folder in (str(path.resolve().parent), str(Path.cwd())):
        if folder not in sys.path:
            sys.path.append(folder)
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 -- any failure of the user's module is a config error of this binding
        raise ConfigError(key, f"{where}: cannot import {module!r} ({type(e).__name__}: {e})") from None


def _resolve_class(path: Path, ref: _Ref, key: str, where: str) -> type:
    if ref.evaluate:
        raise ConfigError(key, f"{where}: got @{ref.name}(); expected a class reference without () (@module.Class)")
    if "/" in ref.name or "." not in ref.name:
        raise ConfigError(key, f"{where}: got @{ref.name}; expected a dotted reference @module.Class")
    module, _, attr = ref.name.rpartition(".")
    obj = getattr(_import(path, module, key, where), attr, None)
    if not inspect.isclass(obj):
        raise ConfigError(key, f"{where}: {module!r} has no class {attr!r} (got {type(obj).__name__})")
    return obj


def _plain(value: Any, macros: dict[str, Any], key: str, where: str) -> Any:
    """Literals as YAML gives them: tuples become lists, macros their values; no references."""
    if isinstance(value, _Macro):
        if value.name not in macros:
            raise ConfigError(key, f"{where}: macro %{value.name} is not defined in the file")
        return _plain(macros[value.name], macros, key, where)
    if isinstance(value, _Ref):
        raise ConfigError(
            key, f"{where}: got @{value.name}; a reference is only allowed as {TOP}.model (the model class)"
        )
    if isinstance(value, (list, tuple)):
        return [_plain(v, macros, key, where) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v, macros, key, where) for k, v in value.items()}
    return value


def _set(raw: dict, parts: list[str], value: Any, key: str, where: str) -> None:
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            if nxt is not None:
                raise ConfigError(key, f"{where}: {'.'.join(parts[: i + 1])} was bound to {nxt!r} above, not a mapping")
            nxt = node[part] = {}
        node = nxt
    node[parts[-1]] = value


def read_gin(path: str | Path) -> GinExperiment:
    """Parse gin file ``path`` into the raw config dict (YAML's shape) and the model selection."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            "config", f"{p} is not UTF-8 text (byte {e.start}: {e.reason}); expected a gin file"
        ) from None
    except OSError as e:
        raise ConfigError("config", f"{p} cannot be read ({e.strerror or e}); expected a readable gin file") from None
    try:
        statements = list(config_parser.ConfigParser(text, _Delegate()))
    except SyntaxError as e:
        loc = e.args[1] if len(e.args) > 1 and isinstance(e.args[1], config_parser.Location) else None
        where = f"{p}:{loc.line_num}:{(loc.char_num or 0) + 1}" if loc is not None else str(p)
        raise ConfigError("config", f"{where}: not valid gin ({e.msg})") from None
    except (ValueError, TypeError) as e:  # e.g. a malformed macro selector
        raise ConfigError("config", f"{p}: not valid gin ({e})") from None

    raw: dict[str, Any] = {}
    macros: dict[str, Any] = {}
    model_ref: tuple[_Ref, str] | None = None
    model_bindings: list[config_parser.BindingStatement] = []
    for st in statements:  # macros first: as in gin, one may be used above its definition
        if isinstance(st, config_parser.BindingStatement) and not st.arg_name and not st.scope:
            macros[st.selector] = st.value
    for st in statements:
        if isinstance(st, config_parser.BlockDeclaration):
            continue  # its bindings follow as statements of their own
        where = _where(p, st.location)
        if isinstance(st, config_parser.IncludeStatement):
            raise ConfigError("config", f"{where}: include is not supported; put the bindings in one file")
        if isinstance(st, config_parser.ImportStatement):
            _import(p, st.module, "config", where)  # e.g. a module registering what it needs
            continue
        key = f"{st.selector}.{st.arg_name}" if st.arg_name else st.selector
        if st.scope:
            raise ConfigError(f"{st.scope}/{key}", f"{where}: scoped bindings are not used by h2jax experiments")
        if not st.arg_name:  # NAME = value: a macro, used as %NAME (read above)
            continue
        parts = key.split(".")
        if parts[0] == TOP and len(parts) == 2 and parts[1] == "model" and isinstance(st.value, _Ref):
            model_ref = (st.value, where)
            continue
        if parts[0] == TOP and len(parts) >= 2:
            parts = parts[1:]
        elif parts[0] not in SECTIONS:
            model_bindings.append(st)
            continue
        _set(raw, parts, _plain(st.value, macros, key, where), key, where)

    model_class, kwargs, arg_where = None, {}, {}
    if model_ref is not None:
        model_class = _resolve_class(p, model_ref[0], f"{TOP}.model", model_ref[1])
    names = {model_ref[0].name, model_ref[0].name.rpartition(".")[2]} if model_ref is not None else set()
    for st in model_bindings:
        key, where = f"{st.selector}.{st.arg_name}", _where(p, st.location)
        if st.selector not in names:
            raise ConfigError(
                key,
                f"{where}: unknown binding; expected {TOP}.name, {TOP}.seed, a key under "
                f"{', '.join(sorted(SECTIONS - {'name', 'seed'}))}, or an argument of the class {TOP}.model selects",
            )
        kwargs[st.arg_name] = _plain(st.value, macros, key, where)
        arg_where[st.arg_name] = where
    if model_class is not None and kwargs:
        # the constructor's own signature: a metaclass (nnx.Module's) may hide it behind *args, **kwargs
        params = dict(inspect.signature(model_class.__init__).parameters)
        params.pop("self", None)
        takes_any = any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values())
        for name in kwargs:
            if not takes_any and name not in params:
                raise ConfigError(
                    f"{model_ref[0].name.rpartition('.')[2]}.{name}",
                    f"{arg_where[name]}: {model_class.__name__} takes no argument {name!r}; it takes {list(params)}",
                )
    return GinExperiment(raw, model_class, kwargs)


def is_gin(path: str | Path | None) -> bool:
    return path is not None and str(path).endswith(".gin")


def model_factory(path: str | Path | None, cfg: ExperimentConfig) -> Callable[[], Any] | None:
    """A zero-argument builder of the user's model a gin file selects (``experiment.model =
    @module.Class``, called with ``nnx.Rngs(cfg.seed)``); None for a YAML file or a gin file that
    selects none (the built-in model). Its ``description`` names the class, its arguments and
    the file: the run's ``config.yaml`` and ``check-config`` say which model trains.

    A builder, not a model: building starts JAX, and the chip types (emulated backends in one
    process, the stage's process group under a launcher) must be registered first -- the
    trainer calls it once they are.
    """
    if not is_gin(path):
        return None
    experiment = read_gin(find_experiment(path))
    factory = experiment.model_factory()
    if factory is None:
        return None
    seed = cfg.seed

    def build() -> Any:
        from flax import nnx

        return factory(nnx.Rngs(seed))

    build.description = f"{experiment.model_description()} from {path}"  # what the run folder records
    return build
