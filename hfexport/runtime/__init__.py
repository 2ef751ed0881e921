"""Runtimes: load and run exported artifacts like the source model."""
