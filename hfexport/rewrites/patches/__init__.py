"""Model patches (stage `patch`), in the order they are installed."""

RULES: list = []
