"""The package version, at the bottom of the layers: modules read it here, never from `hfexport` itself."""

__version__ = "0.1.0"
