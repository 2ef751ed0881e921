"""Rules from outside hfexport: which module a name means, and the rules such a module lists.

A module of rules lists them, in order, as `RULES`, like a stage package of hfexport does; rule `<stage>/<name>` is
the object `<name>` (dashes as underscores) in that module, or in its submodule `<name>` (what
`load_rules(__name__, [ids])` builds from one file per rule). A distribution makes its module known under a short
name with an entry point of the group `hfexport.rules` (`countdown = "countdown_rules"` in its
`[project.entry-points."hfexport.rules"]`).

Nothing here imports a module of rules unless asked to by name: an installed entry point is only listed (from the
distribution's metadata), and it runs when the user names it (`--rules NAME`, `HFEXPORT_RULES=NAME` or
`hfexport.register_rules(NAME)`). A rule runs code inside every trace it is installed in and changes what the
artifact computes, so, as hfexport runs a model folder's own code only with `--trust-remote-code`, it runs rules from
outside only when the user names them (docs/authoring-rules.md, "Rules outside hfexport").

The registry (`RuleRegistry.register_module`) checks the rules themselves, as it checks hfexport's own.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterable
from types import ModuleType

from hfexport.rewrites.rule import Rule, RuleDefinitionError, RuleOrigin, module_name

ENTRY_POINT_GROUP = "hfexport.rules"
# Comma-separated entry point or module names whose rules every export of this process (and its children) uses.
ENVIRONMENT_VARIABLE = "HFEXPORT_RULES"

_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def installed() -> list[RuleOrigin]:
    """The `hfexport.rules` entry points of the installed distributions, read from their metadata (nothing is
    imported): one origin per entry point, its `module` the entry point's value."""
    from importlib.metadata import entry_points

    found = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        dist = point.dist
        found.append(
            RuleOrigin(
                module=point.value,
                entry_point=point.name,
                distribution=dist.name if dist is not None else "",
                version=dist.version if dist is not None else "",
            )
        )
    return sorted(found, key=lambda origin: origin.entry_point)


def requested(environ: os._Environ[str] | dict[str, str] | None = None) -> list[str]:
    """The names in HFEXPORT_RULES, in order."""
    value = (os.environ if environ is None else environ).get(ENVIRONMENT_VARIABLE, "")
    return [name.strip() for name in value.split(",") if name.strip()]


def resolve(name: str) -> RuleOrigin:
    """The origin `name` means: the entry point of that name, else the module of that name (with the distribution
    whose entry point names it, if one does)."""
    packages = installed()
    by_entry_point = [origin for origin in packages if origin.entry_point == name]
    if by_entry_point:
        origin = by_entry_point[0]
        if not _MODULE_RE.match(origin.module):
            raise RuleDefinitionError(
                f"the {ENTRY_POINT_GROUP} entry point {name!r} of {origin.distribution} names {origin.module!r}; "
                "it must name a module (the module that lists its rules as RULES)"
            )
        return origin
    if not _MODULE_RE.match(name):
        raise RuleDefinitionError(f"{name!r} is neither an {ENTRY_POINT_GROUP} entry point nor a module name{_hint()}")
    return next((origin for origin in packages if origin.module == name), RuleOrigin(module=name))


def origin_of(module: ModuleType) -> RuleOrigin:
    """The origin of a module object given directly (its distribution, if an entry point names it)."""
    return next((o for o in installed() if o.module == module.__name__), RuleOrigin(module=module.__name__))


def import_rules_module(origin: RuleOrigin) -> ModuleType:
    """Import the module of `origin`; any failure is a `RuleDefinitionError` that says which module and why."""
    name = origin.module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise RuleDefinitionError(f"no module or {ENTRY_POINT_GROUP} entry point named {name!r}{_hint()}") from None
        raise RuleDefinitionError(f"importing {name} failed: ModuleNotFoundError: {exc}") from exc
    except RuleDefinitionError as exc:
        # A rule of the module refused at construction (RuleMeta, a kind): the message names the rule.
        raise RuleDefinitionError(f"{name}: {exc}") from None
    except Exception as exc:
        raise RuleDefinitionError(f"importing {name} failed: {type(exc).__name__}: {exc}") from exc


def listed_rules(module: ModuleType, known: Iterable[Rule] = ()) -> list[Rule]:
    """The rules `module` lists as `RULES`, in order, after checking that each is where its id says (the object
    `<name>` in the module or in its submodule `<name>`) and that the module defines no rule it does not list.
    `known`: rules registered already (hfexport's own), which a module may import without listing them."""
    name = module.__name__
    listed = getattr(module, "RULES", None)
    if not isinstance(listed, list | tuple):
        raise RuleDefinitionError(
            f"{name}: a module of rules lists them, in the order they run, as `RULES` (a list of rules; "
            "`load_rules(__name__, [ids])` builds it from one module per rule)"
        )
    for rule in listed:
        if not isinstance(rule, Rule):
            raise RuleDefinitionError(f"{name}: RULES holds {rule!r}, which is not a rule")
        attribute = module_name(rule.id)
        homes = (module, sys.modules.get(f"{name}.{attribute}"))
        if not any(home is not None and getattr(home, attribute, None) is rule for home in homes):
            raise RuleDefinitionError(
                f"{name}: rule {rule.id!r} must be the object `{attribute}` in {name} or in {name}.{attribute} "
                "(its id names it, as for hfexport's own rules)"
            )
    others = {id(rule) for rule in (*listed, *known)}
    unlisted = sorted({rule.id for rule in _rules_in(module) if id(rule) not in others})
    if unlisted:
        raise RuleDefinitionError(f"{name}: defines {unlisted} but does not list them in RULES")
    return list(listed)


def _rules_in(module: ModuleType) -> list[Rule]:
    """The rules bound to names in `module` and in its submodules imported so far."""
    prefix = module.__name__ + "."
    modules = [module, *(m for n, m in list(sys.modules.items()) if n.startswith(prefix) and m is not None)]
    return [value for m in modules for value in vars(m).values() if isinstance(value, Rule)]


def _hint() -> str:
    names = [f"{o.entry_point} ({o.distribution})" for o in installed()]
    return f"; installed {ENTRY_POINT_GROUP} entry points: {', '.join(names)}" if names else ""
