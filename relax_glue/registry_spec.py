"""One declaration per registry operation: ``@operation(kind, timed=...)`` on the registry's method.

The method's name is the operation's name, its signature the operation's arguments, and the
decorator says what kind of operation it is. Everything that forwards or hosts operations reads
this declaration and nothing else:

* the op tables of :mod:`relax_glue.registry` (``PUBLISHER_OPS``, ``MUTATING_OPS``, ``TIMED_OPS``,
  ``PUBLIC_OPS``, ...) are :func:`op_table` of the registry class;
* the durable store journals the mutating ops, replays them and carries out the derived ones;
* the actor's dispatch and the clients allow ``PUBLIC_OPS``, fill in the publisher token for
  ``PUBLISHER_OPS`` and stamp the host's clock on ``TIMED_OPS``;
* the typed surfaces (:class:`~relax_glue.registry_ops.RegistryOps`, ``AsyncRegistryAPI``) stay
  written out for static checkers, and ``tests/trainer_tests/test_registry_op_surfaces.py``
  holds every one of them to this table, op by op and signature by signature.

Adding an operation is its method with this decorator (the rule), plus its typed forms, which the
surface test names when they are missing.

A publisher operation's declaration is also its authority check: the decorator checks the
publisher token before the method runs (before any argument is read), so no publication op can
forget it and a stray caller gets NOT_PUBLISHER with nothing changed and nothing replayed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from enum import StrEnum
from typing import Any, TypeVar, cast

__all__ = ["OpKind", "OpSpec", "OpTable", "op_table", "operation"]

F = TypeVar("F", bound=Callable[..., Any])
SPEC_ATTR = "__registry_op__"


class OpKind(StrEnum):
    """What an operation does to the registry, which decides who may call it and what is journaled."""

    # A transition only the publisher may make (versions, the default, the cohort, capacity):
    # takes a keyword-only ``publisher_token``, checked first.
    PUBLISHER = "publisher"
    # A transition anyone may make: session and lease ops (rollout workers), the store's pruning.
    SESSION = "session"
    # Changes soft state only (a lease's deadline in memory), never journaled: a restart
    # re-creates that state (every live lease gets a fresh TTL), so a keep-alive writes nothing.
    SOFT = "soft"
    # Decided on the soft state, carried out by a journaled op with the decision as its argument
    # (expire_leases = end_leases(leases_due(now))): a replay never depends on an unjournaled clock.
    DERIVED = "derived"
    # Reads; changes nothing.
    QUERY = "query"


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """The declaration of one operation."""

    name: str
    kind: OpKind
    # Takes the registry's clock as ``now`` (unix seconds). The registry stays pure: whoever hosts
    # it (the actor, an in-process client, the store) stamps ``now`` once, before the call.
    timed: bool = False

    @property
    def mutating(self) -> bool:
        """A journaled transition (publisher or session op)."""
        return self.kind in (OpKind.PUBLISHER, OpKind.SESSION)


def operation(kind: OpKind, *, timed: bool = False) -> Callable[[F], F]:
    """Declare the decorated registry method an operation of ``kind``.

    A PUBLISHER operation is wrapped: ``self._authorize(name, publisher_token)`` runs first, then
    the method, with the same arguments (the method keeps ``publisher_token`` in its signature,
    keyword-only, so readers and checkers see what callers pass)."""

    def declare(method: F) -> F:
        spec = OpSpec(method.__name__, kind, timed)
        op: Callable[..., Any] = method
        if kind is OpKind.PUBLISHER:

            @functools.wraps(method)
            def op(self: Any, *args: Any, publisher_token: str | None = None, **kwargs: Any) -> Any:
                self._authorize(spec.name, publisher_token)
                return method(self, *args, publisher_token=publisher_token, **kwargs)

        setattr(op, SPEC_ATTR, spec)
        return cast(F, op)

    return declare


def spec_of(attr: Any) -> OpSpec | None:
    """The declaration on a method (None for a method that is no operation)."""
    spec = getattr(attr, SPEC_ATTR, None)
    return spec if isinstance(spec, OpSpec) else None


@dataclasses.dataclass(frozen=True)
class OpTable:
    """Every operation a class declares, in declaration order, and the name tables derived from it."""

    specs: tuple[OpSpec, ...]

    def names(self, *kinds: OpKind) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs if s.kind in kinds)

    @property
    def public(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def timed(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs if s.timed)

    def __getitem__(self, name: str) -> OpSpec:
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(name)


def op_table(cls: type) -> OpTable:
    """The operations ``cls`` declares (on itself or its parts), the class's own first, each part's
    in its definition order. An override's declaration (first in MRO order) is the one read; a
    declaration carried under another name (an alias) is an error."""
    seen: dict[str, OpSpec] = {}
    for klass in cls.__mro__:
        for name, attr in vars(klass).items():
            spec = spec_of(attr)
            if spec is None or name in seen:
                continue  # an override's declaration (seen first, in MRO order) wins
            if spec.name != name:
                raise TypeError(f"{klass.__name__}.{name} carries the declaration of {spec.name}")
            seen[name] = spec
    return OpTable(tuple(seen.values()))
