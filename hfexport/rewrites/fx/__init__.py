"""FX graph fixes (stage `fx`), in the order they run."""

RULES: list = []
