"""A traced program re-emitted one primitive at a time: the seam where a numerics policy
changes the arithmetic, and where the B/W split of a stage's backward re-evaluates it.

A function (e.g. ``jax.value_and_grad`` of the loss) is traced once with ``jax.make_jaxpr``
and flattened into a list of :class:`Op` -- every nested ``jit``, ``remat`` and custom-rule
call inlined, so each op is one primitive, named by the Flax module path it came from
(:func:`module_scopes` pushes a ``jax.named_scope`` per module call while tracing), its
direction (``bwd`` when JAX's name stack says it was transposed) and its source line.

The flat program is then re-evaluated (:func:`evaluate`) with :func:`run_op`, which is where
a chip type's policy changes the arithmetic: every ``dot_general`` gets the policy's precision
config and, for ``matmul_input_rounding``, its floating inputs go through
``lax.reduce_precision`` (round to nearest even to 7 or 10 mantissa bits) before the
fp32-accumulated product. Both are real parts of the compiled program (``reduce-precision``
ops and ``operand_precision`` in the HLO), not a simulation beside it. :func:`apply_policy`
wraps a function so that, under ``jax.jit``, it compiles to exactly that program; the
runtime compiles a chip type's stage programs through it and ``h2jax.align`` measures them.

:func:`bind_eqn` re-emits one equation of a jaxpr as ``jax.core.eval_jaxpr`` does, for
interpreters that walk a jaxpr without flattening it (``h2jax.runtime``'s B/W split).

:class:`Fault` is a test-only hook: one primitive's outputs perturbed by a relative error,
optionally only inside one module and one direction, to prove ``h2jax align`` finds real faults.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.extend import source_info_util

from h2jax.plan import NumericsPolicy

_PRECISIONS = {"default": lax.Precision.DEFAULT, "high": lax.Precision.HIGH, "highest": lax.Precision.HIGHEST}
# call-like primitives whose body is inlined (evaluated, never differentiated, so a custom
# rule's primal body is the right thing to run)
_BODY_PARAMS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}
_PATH = re.compile(r"^[A-Za-z_]\w*(\.\w+)*$")


class PolicyError(RuntimeError):
    """A policy cannot be applied to this program (one line says which op and why)."""


# -- module paths in the name stack ------------------------------------------------------------
_scope_lock = threading.Lock()
_known_paths: set[str] = set()  # every module path module_scopes has pushed, so that other scopes
# in the name stack (jax.checkpoint's "rematted_computation", einsum specs) are not taken for modules


@contextlib.contextmanager
def module_scopes(root: Any) -> Iterator[list[str]]:
    """While tracing, every call of a submodule of ``root`` runs inside ``jax.named_scope(path)``.

    ``path`` is the module's attribute path (``blocks.3.attn``); the root itself gets none.
    Yields the list of paths. The classes' ``__call__`` are patched for the duration (and
    restored), because Python looks ``__call__`` up on the type, not the instance.
    """
    from flax import nnx

    paths: dict[int, str] = {}
    for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Module) and path:
            paths[id(node)] = ".".join(str(p) for p in path)
    classes = {type(m) for _, m in nnx.iter_graph(root) if isinstance(m, nnx.Module)}
    with _scope_lock:
        _known_paths.update(paths.values())
        saved = {cls: cls.__dict__.get("__call__") for cls in classes}
        for cls in classes:
            call = cls.__call__

            def scoped(self, *args, _call=call, **kwargs):
                path = paths.get(id(self))
                if path is None:
                    return _call(self, *args, **kwargs)
                with jax.named_scope(path):
                    return _call(self, *args, **kwargs)

            cls.__call__ = scoped
        try:
            yield sorted(paths.values())
        finally:
            for cls, call in saved.items():
                if call is None:
                    del cls.__call__
                else:
                    cls.__call__ = call


def _strip_transforms(component: str) -> str:
    while "(" in component and component.endswith(")"):
        component = component[component.index("(") + 1 : -1]
    return component


def module_of(name_stack: str) -> str:
    """The innermost module path in a name stack (``transpose(jvp(blocks.1))/blocks.1.attn`` -> ``blocks.1.attn``)."""
    found = ""
    for component in name_stack.split("/"):
        component = _strip_transforms(component)
        if component in _known_paths or (not _known_paths and _PATH.match(component)):
            found = component
    return found


def direction_of(name_stack: str) -> str:
    """``bwd`` for ops JAX made by transposing (the backward pass), else ``fwd``."""
    return "bwd" if "transpose(" in name_stack else "fwd"


_FRAME = re.compile(r"^(?P<path>.*?):(?P<line>\d+)(?::\d+)? \(.*\)$")  # summarize's "file:line[:col] (fn)"


def _source_of(eqn: Any) -> str:
    """``path:line`` of the user code that emitted ``eqn`` (relative when under the cwd), or ""."""
    match = _FRAME.match(source_info_util.summarize(eqn.source_info))
    if match is None:
        return ""
    path = match["path"]
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            path = rel
    if path.startswith("/"):
        path = "/".join(path.split("/")[-2:])
    return f"{path}:{match['line']}"


def bind_eqn(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Re-emit one jaxpr equation on ``invals`` as ``jax.core.eval_jaxpr`` does (its context
    manager included); always a list of outputs."""
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


# -- the flat program --------------------------------------------------------------------------
@dataclass(frozen=True)
class Lit:
    """A literal operand of an op."""

    value: Any


@dataclass(frozen=True, eq=False)
class Op:
    """One primitive application of a flattened program."""

    index: int
    primitive: Any
    params: dict[str, Any]
    invars: tuple[int | Lit, ...]  # slot ids or literals
    outvars: tuple[int | None, ...]  # slot ids; None: the result is dropped
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    name_stack: str
    module: str
    direction: str
    source: str
    opaque: bool = False  # has a body (scan, cond, ...) that is run as a whole

    @property
    def name(self) -> str:
        return self.primitive.name

    def label(self) -> str:
        """``dot_general @ blocks.3.attn (bwd) h2jax/models/_gpt.py:93``"""
        where = self.module or "(model)"
        return f"#{self.index} {self.name} @ {where} ({self.direction}) {self.source}".rstrip()


@dataclass
class FlatProgram:
    """A jaxpr with every call inlined: consts, inputs, ops in order, outputs."""

    ops: list[Op]
    in_slots: list[int]
    out_atoms: list[int | Lit]
    consts: list[tuple[int, Any]]
    out_tree: Any = None
    frees: dict[int, list[int]] = field(default_factory=dict)  # op index -> slots dead after it

    def modules(self) -> list[str]:
        return sorted({op.module for op in self.ops if op.module})


def _sub_jaxprs(params: dict[str, Any]) -> list[Any]:
    out = []
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jcore.ClosedJaxpr):
                out.append(v.jaxpr)
            elif isinstance(v, jcore.Jaxpr):
                out.append(v)
    return out


def _contains_dot(params: dict[str, Any]) -> bool:
    return any(
        e.primitive.name == "dot_general" or _contains_dot(e.params) for j in _sub_jaxprs(params) for e in j.eqns
    )


def flatten(closed: Any, out_tree: Any = None) -> FlatProgram:
    """Inline every call of ``closed`` (a ClosedJaxpr) into one list of ops."""
    counter = iter(range(1 << 62))
    ops: list[Op] = []
    consts: list[tuple[int, Any]] = []

    def walk(jaxpr: Any, env: dict[Any, int | Lit], stack: str) -> None:
        def atom(v: Any) -> int | Lit:
            return Lit(v.val) if isinstance(v, jcore.Literal) else env[v]

        for eqn in jaxpr.eqns:
            inner = str(eqn.source_info.name_stack)
            here = f"{stack}/{inner}" if stack and inner else stack or inner
            body = _BODY_PARAMS.get(eqn.primitive.name)
            if body is not None and body in eqn.params:
                sub = eqn.params[body]
                sub_jaxpr = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                sub_env: dict[Any, int | Lit] = {}
                if isinstance(sub, jcore.ClosedJaxpr):
                    for v, c in zip(sub_jaxpr.constvars, sub.consts):
                        slot = next(counter)
                        consts.append((slot, c))
                        sub_env[v] = slot
                else:
                    for v in sub_jaxpr.constvars:
                        raise PolicyError(f"{eqn.primitive.name}: an open body with constants ({v}) cannot be inlined")
                n_in = len(sub_jaxpr.invars)
                for v, a in zip(sub_jaxpr.invars, eqn.invars[-n_in:] if n_in else []):
                    sub_env[v] = atom(a)
                walk(sub_jaxpr, sub_env, here)
                for outer, v in zip(eqn.outvars, sub_jaxpr.outvars):
                    if not isinstance(outer, jcore.DropVar):
                        env[outer] = Lit(v.val) if isinstance(v, jcore.Literal) else sub_env[v]
                continue
            outslots = []
            for v in eqn.outvars:
                if isinstance(v, jcore.DropVar):
                    outslots.append(None)
                else:
                    env[v] = next(counter)
                    outslots.append(env[v])
            ops.append(
                Op(
                    index=len(ops),
                    primitive=eqn.primitive,
                    params=dict(eqn.params),
                    invars=tuple(atom(v) for v in eqn.invars),
                    outvars=tuple(outslots),
                    in_avals=tuple(v.aval for v in eqn.invars),
                    out_avals=tuple(v.aval for v in eqn.outvars),
                    name_stack=here,
                    module=module_of(here),
                    direction=direction_of(here),
                    source=_source_of(eqn),
                    opaque=bool(_sub_jaxprs(eqn.params)),
                )
            )

    jaxpr = closed.jaxpr
    env: dict[Any, int | Lit] = {}
    for v, c in zip(jaxpr.constvars, closed.consts):
        env[v] = next(counter)
        consts.append((env[v], c))
    in_slots = []
    for v in jaxpr.invars:
        env[v] = next(counter)
        in_slots.append(env[v])
    walk(jaxpr, env, "")
    out_atoms = [Lit(v.val) if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]
    prog = FlatProgram(ops, in_slots, out_atoms, consts, out_tree)
    keep = {a for a in out_atoms if isinstance(a, int)}
    last: dict[int, int] = {}
    for op in ops:
        for a in op.invars:
            if isinstance(a, int):
                last[a] = op.index
    for slot, index in last.items():
        if slot not in keep:
            prog.frees.setdefault(index, []).append(slot)
    return prog


def trace(fn: Callable, *args: Any) -> FlatProgram:
    """Trace ``fn(*args)`` (arrays or ShapeDtypeStructs) and flatten it."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), args)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*shapes)
    return flatten(closed, jax.tree.structure(out_shape))


# -- evaluating ops ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    """TEST-ONLY: ``primitive``'s floating outputs times (1 + rel_error), optionally only in one
    module (the path or anything under it) and one direction (fwd | bwd)."""

    primitive: str
    rel_error: float
    module: str | None = None
    direction: str | None = None

    def matches(self, op: Op) -> bool:
        if op.name != self.primitive:
            return False
        if self.direction is not None and op.direction != self.direction:
            return False
        if self.module is not None and not (op.module == self.module or op.module.startswith(self.module + ".")):
            return False
        return True

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``PRIMITIVE:REL_ERROR[:MODULE[:DIRECTION]]``, e.g. ``exp:1e-3:blocks.2:fwd``."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 4:
            raise ValueError(f"fault {text!r}: expected PRIMITIVE:REL_ERROR[:MODULE[:fwd|bwd]]")
        try:
            rel = float(parts[1])
        except ValueError:
            raise ValueError(f"fault {text!r}: REL_ERROR {parts[1]!r} is not a number") from None
        module = parts[2] or None if len(parts) > 2 else None
        direction = parts[3] or None if len(parts) > 3 else None
        if direction not in (None, "fwd", "bwd"):
            raise ValueError(f"fault {text!r}: direction {direction!r} is not fwd or bwd")
        return cls(parts[0], rel, module, direction)


@dataclass(frozen=True)
class ScopedPolicy:
    """Policies by module path prefix (the longest match wins), ``default`` elsewhere: the
    numerics of a heterogeneous plan, where each stage's layers compute as its chip type does."""

    default: NumericsPolicy
    scopes: tuple[tuple[str, NumericsPolicy], ...] = ()

    def for_module(self, module: str) -> NumericsPolicy:
        best, policy = -1, self.default
        for prefix, p in self.scopes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, policy = len(prefix), p
        return policy


PolicyLike = NumericsPolicy | ScopedPolicy


def _policy_for(policy: PolicyLike, op: Op) -> NumericsPolicy:
    return policy.for_module(op.module) if isinstance(policy, ScopedPolicy) else policy


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def run_op(op: Op, invals: Sequence[Any], policy: PolicyLike, fault: Fault | None = None) -> list[Any]:
    """Evaluate ``op`` on ``invals`` as a chip type with ``policy`` computes it (traceable)."""
    params = op.params
    pol = _policy_for(policy, op)
    if op.name == "dot_general":
        bits = pol.mantissa_bits
        if bits is not None:
            invals = [
                lax.reduce_precision(x, exponent_bits=8, mantissa_bits=bits)
                if _is_float(x) and jnp.finfo(jnp.result_type(x)).nmant > bits
                else x
                for x in invals
            ]
        prec = _PRECISIONS[pol.matmul_precision]
        params = dict(params, precision=(prec, prec))
    elif op.opaque and not pol.is_exact and _contains_dot(op.params):
        raise PolicyError(f"{op.label()}: the policy cannot reach the matmuls inside a {op.name} body")
    outs = op.primitive.bind(*invals, **params)
    outs = list(outs) if op.primitive.multiple_results else [outs]
    if fault is not None and fault.matches(op):
        outs = [o * jnp.asarray(1 + fault.rel_error, jnp.result_type(o)) if _is_float(o) else o for o in outs]
    return outs


def read_atom(env: dict[int, Any], atom: int | Lit) -> Any:
    return atom.value if isinstance(atom, Lit) else env[atom]


def evaluate(
    prog: FlatProgram,
    args: Sequence[Any],
    step: Callable[[Op, list[Any]], list[Any]],
    *,
    visit: Callable[[Op, list[Any], list[Any]], None] | None = None,
    const: Callable[[Any], Any] = lambda c: c,
) -> list[Any]:
    """Run the flat program with ``step(op, invals) -> outvals`` for each op; ``visit`` sees
    every op's inputs and outputs. Values are dropped after their last use."""
    env: dict[int, Any] = {slot: const(c) for slot, c in prog.consts}
    env.update(zip(prog.in_slots, args))
    for op in prog.ops:
        invals = [read_atom(env, a) for a in op.invars]
        outs = step(op, invals)
        if visit is not None:
            visit(op, invals, outs)
        for slot, value in zip(op.outvars, outs):
            if slot is not None:
                env[slot] = value
        for slot in prog.frees.get(op.index, ()):
            env.pop(slot, None)
    return [read_atom(env, a) for a in prog.out_atoms]


def apply_policy(fn: Callable, policy: PolicyLike, *, fault: Fault | None = None) -> Callable:
    """``fn`` as a chip type with ``policy`` computes it: same signature, traceable, jittable.

    The function is traced to a jaxpr on each call (cheap next to compiling it) and every op
    re-emitted through :func:`run_op`; wrap the result in ``jax.jit`` to get one program.
    """

    def wrapped(*args: Any) -> Any:
        prog = trace(fn, *args)
        leaves = jax.tree.leaves(args)
        outs = evaluate(prog, leaves, lambda op, xs: run_op(op, xs, policy, fault))
        return jax.tree.unflatten(prog.out_tree, outs)

    return wrapped
