"""What loading or saving an artifact raises: every refusal is one of these, with a message saying why."""

from __future__ import annotations


class ArtifactError(ValueError):
    """A saved export that cannot be loaded as it is (missing, corrupt, or not what its manifest says)."""


class ManifestError(ArtifactError):
    """A manifest that is not valid JSON of the documented schema, or that names code."""


class UnsafePathError(ManifestError):
    """A manifest file path that is absolute, has `..`, or leads outside the artifact folder."""


class UntrustedArtifactError(ArtifactError):
    """A file that deserialises with pickle (a torch `.pt2`), loaded without `trust=True`."""


class ArtifactExistsError(FileExistsError):
    """The destination of a save exists and `overwrite` was not given (or it is not an artifact)."""


class FailedValidationWarning(UserWarning):
    """An artifact whose manifest records a failed `--validate` (it differs from eager, or the check could not
    run) was loaded: it loads, since the files are whole, but its outputs were not shown to match the model."""
