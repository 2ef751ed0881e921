"""`hfexport rules list` and `hfexport rules show ID`: the registered rewrite rules."""

from __future__ import annotations

import argparse
import difflib
import shutil

from hfexport.cli.exits import UsageError


def cmd_rules_list(args: argparse.Namespace) -> int:
    from hfexport.rewrites.engine import default_registry

    rules = [r for r in default_registry().rules(args.stage) if args.backend is None or args.backend in r.meta.backends]
    rows = [("rule", "kind", "backends", "why")]
    for rule in rules:
        meta = rule.meta
        expires = f" [expires {meta.expires}]" if meta.expires else ""
        rows.append((meta.id, meta.kind, ",".join(meta.backends), f"{meta.why}{expires}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    # Aligned to the terminal: the `why` is cut to fit (`rules show ID` prints it whole).
    width = shutil.get_terminal_size((120, 24)).columns
    for row in rows:
        line = "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
        print(line if len(line) <= width else line[: max(width - 1, 40)] + "…")
    print(f"{len(rules)} rule(s); `hfexport rules show ID` prints one whole")
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
    from hfexport.audit import expiry_status, rule_diff, rule_location, rule_sources, rule_target
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
        from hfexport.versions import installed_version

        installed = installed_version(upstream.package) or "not installed"
        fields.insert(3, ("", f"(written against {upstream.package} {upstream.version}; installed: {installed})"))
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
