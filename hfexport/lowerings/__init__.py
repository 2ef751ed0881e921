"""Lowerings: from a captured ExportedProgram to each backend's native program."""
