"""Saved exports: a folder of model files and a manifest, written all or nothing and loaded without trusting it.

    hfexport.save(exported, "out/", config=config, report=exporter.report)   # one native object
    hfexport.save({"prefill": ep1, "decode": ep2}, "out/")                  # one per component
    loaded = hfexport.load("out/")                                          # trust=True for a .pt2
    outputs = loaded.run(inputs)              # {output name: tensor}, in the artifact's own runtime
    validation = validate("out/", model, inputs)   # the artifact in its runtime against eager

| module | job |
|---|---|
| `errors` | what a refused save or load raises |
| `paths` | what a manifest file path may look like |
| `formats` | `ArtifactFormat`: a backend's record of how a component is written and checked; `ARTIFACT_FORMATS` |
| `manifest` | the manifest schema and its checks; `read_manifest`, `check_files`, `update_manifest` |
| `publish` | `save` (write every component, then the manifest, then publish in one rename), `check_destination` |
| `hf_files` | the Hugging Face files saved beside an export (config, generation config, tokenizer, processor) |
| `loaded` | `load`, `LoadedExport`, `LoadedComponent` (run in the format's runtime: `hfexport.runtime.drivers`) |
| `validation` | `validate`, `compare`, `Validation`: the artifact against eager, output by output |
| `eval_text` | held-out text on every machine: the Python stdlib's source, split by a hash of each file's name |
| `accuracy` | `quantization_accuracy`: a quantized export against its float model on held-out text; `BUDGETS` |

Writing to disk goes through `hfexport.core.files` (the one atomic-write implementation).

What differs per format (the files, how they are written, checked and opened) is each backend's
`ArtifactFormat` and `Runtime`, in its folder (`hfexport/backends/<name>/artifact.py`, `driver.py`).
"""

from __future__ import annotations

from hfexport.artifacts.errors import (
    ArtifactError,
    ArtifactExistsError,
    FailedValidationWarning,
    ManifestError,
    UnsafePathError,
    UntrustedArtifactError,
)
from hfexport.artifacts.formats import ARTIFACT_FORMATS, ArtifactFormat
from hfexport.artifacts.loaded import LoadedComponent, LoadedExport, load
from hfexport.artifacts.manifest import (
    MANIFEST,
    MANIFEST_VERSION,
    MAX_MANIFEST_BYTES,
    REPORT,
    SINGLE,
    check_files,
    check_manifest,
    read_manifest,
    update_manifest,
    validation_verdict,
)
from hfexport.artifacts.manifest_values import MAX_DEPTH
from hfexport.artifacts.paths import check_path
from hfexport.artifacts.publish import check_destination, export_format_of, save
from hfexport.artifacts.validation import OutputDiff, Validation, compare, eager_outputs, run_artifact, validate
from hfexport.formats import FORMATS, MAIN_FILE
from hfexport.naming import named_outputs, plain_name

__all__ = [
    "ARTIFACT_FORMATS",
    "FORMATS",
    "MAIN_FILE",
    "MANIFEST",
    "MANIFEST_VERSION",
    "MAX_DEPTH",
    "MAX_MANIFEST_BYTES",
    "REPORT",
    "SINGLE",
    "ArtifactError",
    "ArtifactExistsError",
    "ArtifactFormat",
    "FailedValidationWarning",
    "LoadedComponent",
    "LoadedExport",
    "ManifestError",
    "OutputDiff",
    "UnsafePathError",
    "UntrustedArtifactError",
    "Validation",
    "check_destination",
    "check_files",
    "check_manifest",
    "check_path",
    "compare",
    "eager_outputs",
    "export_format_of",
    "load",
    "named_outputs",
    "plain_name",
    "read_manifest",
    "run_artifact",
    "save",
    "update_manifest",
    "validate",
    "validation_verdict",
]
