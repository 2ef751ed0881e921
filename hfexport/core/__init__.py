"""The base layers: exceptions, version checks, files, checkpoints, cache pytrees, position templates."""
