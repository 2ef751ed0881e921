"""`hfexport rules list`, `rules show ID` and `rules test MODULE`: the registered rewrite rules, and the checks of a
module of rules from outside hfexport; `--rules NAME`, the option that registers such a module for one command."""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
from collections import Counter
from typing import TYPE_CHECKING

from hfexport.cli.exits import ExitCode, UsageError, one_line

if TYPE_CHECKING:
    from hfexport.rewrites.rule import Rule
    from hfexport.testing.harness import ExampleCheck


def register_named_rules(names: list[str] | None) -> None:
    """`--rules NAME[,NAME]`: register each module of rules (an entry point or module name) for this command, and
    name them in HFEXPORT_RULES for the processes it starts (the sweep's exports). A refused module is a usage
    error: nothing ran yet."""
    from hfexport.rewrites import external
    from hfexport.rewrites.registry import default_registry, register_rules
    from hfexport.rewrites.rule import RuleDefinitionError

    wanted = [name.strip() for value in names or () for name in value.split(",") if name.strip()]
    if external.requested():
        # HFEXPORT_RULES is read when the registry is first built: refuse a bad name now, not halfway through.
        try:
            default_registry()
        except RuleDefinitionError as exc:
            raise UsageError(str(exc)) from None
    for name in wanted:
        try:
            register_rules(name)
        except RuleDefinitionError as exc:
            raise UsageError(f"--rules {name}: {exc}") from None
    known = external.requested()
    added = [name for name in wanted if name not in known]
    if added:
        os.environ[external.ENVIRONMENT_VARIABLE] = ",".join([*known, *added])


def cmd_rules_list(args: argparse.Namespace) -> int:
    from hfexport.rewrites import external
    from hfexport.rewrites.engine import default_registry
    from hfexport.rewrites.rule import BUILTIN_ORIGIN

    registry = default_registry()
    rules = [r for r in registry.rules(args.stage) if args.backend is None or r.applies_to(args.backend)]
    # The origin column only when rules from outside hfexport are registered (every other row would say hfexport).
    with_origin = any(rule.origin is not None for rule in rules)
    rows = [("rule", "kind", "backends", *(("origin",) if with_origin else ()), "why")]
    for rule in rules:
        meta = rule.meta
        expires = f" [expires {meta.expires}]" if meta.expires else ""
        origin = ((rule.origin.module if rule.origin else BUILTIN_ORIGIN),) if with_origin else ()
        rows.append((meta.id, meta.kind, ",".join(meta.backends), *origin, f"{meta.why}{expires}"))
    columns = len(rows[0]) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(columns)]
    # Aligned to the terminal: the `why` is cut to fit (`rules show ID` prints it whole).
    width = shutil.get_terminal_size((120, 24)).columns
    for row in rows:
        # Only the `why` is cut, never the columns before it (a narrow terminal still shows id, kind, origin).
        start = "  ".join(c.ljust(w) for c, w in zip(row[:columns], widths, strict=True)) + "  "
        room = max(width - len(start), 2)
        why = row[-1]
        print(start + (why if len(why) <= room else why[: room - 1] + "…"))
    external_count = sum(rule.origin is not None for rule in rules)
    from_outside = f", {external_count} from outside hfexport" if external_count else ""
    print(f"{len(rules)} rule(s){from_outside}; `hfexport rules show ID` prints one whole")
    # Installed rule packages are listed from their metadata only: their code runs once the user names them.
    idle = [o for o in external.installed() if o.module not in registry.modules()]
    for origin in idle:
        print(
            f"not enabled: {origin.entry_point} ({origin.module}, {origin.distribution} {origin.version}); "
            f"use it with --rules {origin.entry_point} or {external.ENVIRONMENT_VARIABLE}={origin.entry_point}"
        )
    return 0


def _did_you_mean(rule_id: str, ids: list[str]) -> str:
    """ "; did you mean ...?" with the closest registered ids: by the whole id, else by its last part (a rule
    named without its stage, or under another stage)."""
    close = difflib.get_close_matches(rule_id, ids, n=3, cutoff=0.6)
    if not close:
        by_name = {i.rsplit("/", 1)[-1]: i for i in ids}
        close = [by_name[n] for n in difflib.get_close_matches(rule_id.rsplit("/", 1)[-1], list(by_name), n=3)]
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def cmd_rules_show(args: argparse.Namespace) -> int:
    from hfexport.rewrites.catalogue import expiry_status, rule_diff, rule_location, rule_sources, rule_target
    from hfexport.rewrites.engine import default_registry

    registry = default_registry()
    try:
        rule = registry.get(args.id)
    except KeyError as exc:
        raise UsageError(str(exc.args[0]) + _did_you_mean(args.id, registry.ids())) from None
    meta = rule.meta
    expired, expiry = expiry_status(meta)
    expiry_text = "never (no expiry set)"
    if meta.expires:
        expiry_text = f"{meta.expires}: " + ("EXPIRED, " if expired else "") + expiry
    print(f"{meta.id}  ({type(rule).__name__}, stage {rule.stage}, kind {meta.kind})")
    location = rule_location(rule)
    upstream = meta.upstream_ref
    fields = [
        ("origin", rule.origin_name),
        ("defined", str(location) if location else "-"),
        ("why", meta.why),
        ("upstream", meta.upstream or "-"),
        ("expires", expiry_text),
        ("backends", ", ".join(meta.backends)),
        *([("variants", "; ".join(", ".join(v) for v in rule.variants()))] if len(rule.variants()) > 1 else []),
        *([("formerly", ", ".join(meta.aliases))] if meta.aliases else []),
        ("models", ", ".join(meta.models) or "-"),
        ("default", "on" if meta.enabled_by_default else "off (enable it with RuleSelection(enable=...))"),
        ("target", rule_target(rule) or "-"),
    ]
    if upstream is not None and upstream.kind == "package":
        # A pin says which release the rule was written against; the installed one may have moved on.
        from hfexport.core.versions import installed_version

        installed = installed_version(upstream.package) or "not installed"
        pinned = f"(written against {upstream.package} {upstream.version}; installed: {installed})"
        fields.insert([name for name, _ in fields].index("upstream") + 1, ("", pinned))
    for name, value in fields:
        print(f"{name + ':' if name else '':10s} {value}")
    print("examples:")
    for example in meta.examples:
        where = f" [{', '.join(example.backends)}]" if example.backends else ""
        print(f"  {type(example).__name__:8s} {example.description or '(no description)'}{where}")
    diff = rule_diff(rule)
    if diff:
        print("diff (patched source -> replacement):")
        print(diff.rstrip())
    else:
        for name, source in rule_sources(rule).items():
            print(f"{name}:")
            print(source.rstrip())
    return 0


def cmd_rules_test(args: argparse.Namespace) -> int:
    """Register a module of rules (the checks hfexport's own rules pass) and check its examples through the real
    exporters and runtimes, as tests/rewrites/test_examples.py does for hfexport's: exit 0 when every check passes,
    1 when one fails, 2 when the module is refused."""
    from hfexport.rewrites.registry import register_rules
    from hfexport.rewrites.rule import RuleDefinitionError
    from hfexport.testing import harness

    try:
        rules = register_rules(args.module)
    except RuleDefinitionError as exc:
        raise UsageError(str(exc)) from None
    if not rules:
        raise UsageError(f"{args.module} lists no rules (RULES is empty)")
    checks = [c for c in harness.example_checks(rules) if args.all or c.default_tier]
    fixes = [r for r in rules if args.all and r.meta.kind == "fix"]
    scope = "every example and backend, each fix's need" if args.all else "first Match and NoMatch per variant"
    print(f"{rules[0].origin_name}: {len(rules)} rule(s), {len(checks) + len(fixes)} check(s) ({scope})")
    statuses: Counter[str] = Counter()
    for status, line in [*(_example_check(check) for check in checks), *(_fix_check(rule) for rule in fixes)]:
        statuses[status] += 1
        print(f"{status:6s} {line}")
    print(", ".join(f"{n} {status}" for status, n in sorted(statuses.items())))
    if not args.all:
        print("`--all` also checks every other example and backend, and that each fix is needed")
    return int(ExitCode.DIFFERS) if statuses["FAIL"] else int(ExitCode.OK)


def _example_check(check: ExampleCheck) -> tuple[str, str]:
    """(ok | xfail | FAIL, what was checked and found): one example on one backend; a declared known failure is a
    strict expected failure (FAIL when it passes)."""
    from hfexport.rewrites.examples import Match

    example = check.example
    what = f"{check.rule.id}  {type(example).__name__} {check.index} on {check.backend}"
    described = f" ({example.description})" if example.description else ""
    try:
        hits = check.run()
    except Exception as exc:  # reported, and the next check runs
        if check.known_failure is not None:
            return "xfail", f"{what}: {check.known_failure}"
        return "FAIL", f"{what}{described}: {one_line(exc)}"
    if check.known_failure is not None:
        return "FAIL", f"{what}: passes, but is declared known_failure ({check.known_failure}): remove the entry"
    found = f"{hits} hit(s)" if isinstance(example, Match) else "no hit, same export as without the rule"
    return "ok", f"{what}: {found}{described}"


def _fix_check(rule: Rule) -> tuple[str, str]:
    """(ok | skip | FAIL, what was found): a Match example of the fix fails without it (or `RuleMeta.needed`)."""
    from hfexport.testing.harness import check_fix_needed

    if rule.meta.needed:
        return "skip", f"{rule.id}  needed: {rule.meta.needed}"
    try:
        proof = check_fix_needed(rule)
    except Exception as exc:  # reported, and the next check runs
        return "FAIL", f"{rule.id}  needed: {one_line(exc)}"
    return "ok", f"{rule.id}  needed: without it, {proof.example.description!r} on {proof.backend}: {proof.how}"
