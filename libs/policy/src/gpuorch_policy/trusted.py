"""Contract models built from values validated already, at a fraction of ``model_construct``'s cost.

The placement engine and the scheduling cycle build a ``NodeAssignment``, a ``JobPlaced`` and its ``LaunchJob``s for
every placement, from parts that were validated already (the job's spec at admission, the GPUs from the fleet's own
inventory). ``model_construct`` skips validation but still walks every field (aliases, defaults) on each call;
``trusted`` copies a per-class template of the defaults instead. The result equals what ``model_construct`` gives
(same ``__dict__``, same fields set) and serializes the same way.

Contract: the caller vouches for the values (types and constraints are NOT checked). Unknown field names and missing
required fields raise ``TypeError`` (a typo must not pass silently).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

M = TypeVar("M", bound=BaseModel)
_Template = tuple[dict[str, Any], tuple[tuple[str, Callable[[], Any]], ...], frozenset[str], frozenset[str]]
_TEMPLATES: dict[type, _Template] = {}
_set = object.__setattr__


def _template(cls: type[BaseModel]) -> _Template:
    if cls.__private_attributes__:
        raise TypeError(f"{cls.__name__} has private attributes: build it with model_construct")
    defaults: dict[str, Any] = {}
    factories: list[tuple[str, Callable[[], Any]]] = []
    required: set[str] = set()
    for name, info in cls.model_fields.items():
        if info.alias is not None and info.alias != name:
            raise TypeError(f"{cls.__name__}.{name} has an alias: build it with model_construct")
        if info.default_factory is not None:
            defaults[name] = None
            factories.append((name, info.default_factory))  # type: ignore[arg-type]
        elif info.default is PydanticUndefined:
            defaults[name] = None
            required.add(name)
        else:
            defaults[name] = info.default
    return defaults, tuple(factories), frozenset(required), frozenset(defaults)


def trusted(cls: type[M], /, **values: Any) -> M:
    """An instance of ``cls`` holding ``values`` (defaults for the rest), not validated (see the module doc)."""
    found = _TEMPLATES.get(cls)
    if found is None:
        found = _TEMPLATES[cls] = _template(cls)
    defaults, factories, required, names = found
    keys = values.keys()
    if not required <= keys or not keys <= names:
        raise TypeError(f"{cls.__name__}: missing {sorted(required - keys)}, unknown {sorted(keys - names)}")
    data = defaults.copy()  # the fields in declaration order, as validation would give them
    data.update(values)
    for name, factory in factories:
        if name not in values:
            data[name] = factory()
    model = cls.__new__(cls)
    _set(model, "__dict__", data)
    _set(model, "__pydantic_fields_set__", set(keys))
    _set(model, "__pydantic_extra__", None)
    _set(model, "__pydantic_private__", None)
    return model


__all__ = ["trusted"]
