"""The rule engine and the rules. See DESIGN.md, "The rule model", and docs/rules.md."""
