"""Frontends: from a model and sample inputs to an ExportedProgram."""
