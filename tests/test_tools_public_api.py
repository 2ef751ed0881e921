"""tools/ runs on hfexport's public names only: a private name (`_x`, or a name inside a `_x` module) is the package's
own business and may change without notice, so a tool that needs one gets a public home for it in the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def private_uses(source: str) -> list[str]:
    """`line: what` for each private hfexport name `source` imports or reaches through an imported name."""
    tree = ast.parse(source)
    bound: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hfexport":
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hfexport":
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
                    bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda use: int(use.split(":", 1)[0]))


def test_the_check_sees_each_way_of_reaching_a_private_name() -> None:
    source = (
        "from hfexport.apps.bench import _private, public\n"
        "from hfexport.rewrites.rules._moe_batched import routed\n"
        "import hfexport.runtime.generation as gen\n"
        "from hfexport import runtime\n"
        "gen._SESSIONS.get(x)\n"
        "runtime.generation._static_mask(v)\n"
        "other._private()\n"  # not a name from hfexport: a tool's own object
        "from hfexport.apps.bench import generation_export\n"
    )
    assert private_uses(source) == [
        "1: from hfexport.apps.bench import _private",
        "2: from hfexport.rewrites.rules._moe_batched import ...",
        "5: gen._SESSIONS",
        "6: runtime.generation._static_mask",
    ]


def test_tools_import_no_private_hfexport_name() -> None:
    tools = sorted((ROOT / "tools").rglob("*.py"))
    assert tools
    found = [f"{path.relative_to(ROOT)}:{use}" for path in tools for use in private_uses(path.read_text())]
    assert not found, "tools reach private hfexport names (give them a public home):\n" + "\n".join(found)
