"""Rule kinds: the bodies a rule can have, one module per stage, each with its own applier."""
