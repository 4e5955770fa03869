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
    return _instance(cls, data, set(keys))


def _instance(cls: type[M], data: dict[str, Any], fields_set: set[str]) -> M:
    model = _new(cls)
    _set_dict(model, data)
    _set_fields_set(model, fields_set)
    _set_extra(model, None)
    _set_private(model, None)
    return model  # type: ignore[no-any-return]


# BaseModel's own slot setters, called directly (``BaseModel.__setattr__`` would validate; ``object.__setattr__``
# looks each name up first)
_new = object.__new__
_set_dict = vars(BaseModel)["__dict__"].__set__
_set_fields_set = vars(BaseModel)["__pydantic_fields_set__"].__set__
_set_extra = vars(BaseModel)["__pydantic_extra__"].__set__
_set_private = vars(BaseModel)["__pydantic_private__"].__set__


def maker(cls: type[BaseModel], names: tuple[str, ...]) -> Callable[..., Any]:
    """``trusted(cls, **dict(zip(names, values)))`` for a fixed tuple of field ``names``, checked once here instead
    of on every call: ``maker(JobPlaced, ("job_id", ...))(job_id, ...)`` (a value short or too many raises
    ``TypeError``). For the hottest paths (a placement builds four models): the function is compiled for ``names``
    (each value stored under its name, no zip), and its result is the same as ``trusted``'s."""
    found = _TEMPLATES.get(cls)
    if found is None:
        found = _TEMPLATES[cls] = _template(cls)
    defaults, factories, required, known = found
    keys = set(names)
    if len(keys) != len(names) or not required <= keys or not keys <= known:
        raise TypeError(f"{cls.__name__}: missing {sorted(required - keys)}, unknown {sorted(keys - known)}, "
                        "or a name twice")
    late = tuple((n, f) for n, f in factories if n not in keys)
    params = ", ".join(f"v{k}" for k in range(len(names)))
    lines = [f"def make_{cls.__name__}({params}):", "    data = defaults.copy()"]
    lines += [f"    data[{name!r}] = v{k}" for k, name in enumerate(names)]  # names are the model's own fields
    lines += [f"    data[{name!r}] = late[{k}][1]()" for k, (name, _f) in enumerate(late)]
    lines += ["    model = new(cls)", "    set_dict(model, data)", "    set_fields_set(model, set(set_names))",
              "    set_extra(model, None)", "    set_private(model, None)", "    return model"]
    scope: dict[str, Any] = {"defaults": defaults, "late": late, "cls": cls, "new": _new, "set_dict": _set_dict,
                             "set_fields_set": _set_fields_set, "set_extra": _set_extra, "set_private": _set_private,
                             "set_names": frozenset(names)}
    exec("\n".join(lines), scope)  # noqa: S102 - source built from checked field names only
    made: Callable[..., Any] = scope[f"make_{cls.__name__}"]
    return made


__all__ = ["maker", "trusted"]
