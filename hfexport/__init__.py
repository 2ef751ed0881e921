"""hfexport: export Hugging Face models through torch.export, with every workaround an audited rule.

Names load lazily so that `import hfexport` imports neither transformers nor any backend package.
"""

from __future__ import annotations

from hfexport._version import __version__ as __version__
from hfexport.backends.registry import backends
from hfexport.core._lazy import lazy_getattr

_EXPORTS = {
    "HfExporter": "hfexport.exporters",
    "ExportConfigMixin": "hfexport.configs",
    "ExportFormat": "hfexport.formats",
    "AutoHfExporter": "hfexport.auto",
    "AutoExportConfig": "hfexport.auto",
    "register_exporter": "hfexport.auto",
    "register_export_config": "hfexport.auto",
    "register_pytree_node": "hfexport.core.cache_pytree",
    "decompose_for_generation": "hfexport.frontends.generation",
    "empty_model": "hfexport.frontends.empty_weights",
    "GenerationComponents": "hfexport.frontends.generation",
    "ExportReport": "hfexport.report",
    "AccuracyRecord": "hfexport.report",
    "AccuracyBudget": "hfexport.artifacts.accuracy",
    "quantization_accuracy": "hfexport.artifacts.accuracy",
    "audit_quantization": "hfexport.apps.quant_audit",
    "load_program": "hfexport.runtime.dynamo",
    "RuleSelection": "hfexport.rewrites.rule",
    "register_rules": "hfexport.rewrites.registry",
    "HfExportError": "hfexport.core.errors",
    "InputError": "hfexport.core.errors",
    "ConfigError": "hfexport.core.errors",
    "MissingPackageError": "hfexport.core.errors",
    "save": "hfexport.artifacts",
    "load": "hfexport.artifacts",
    "LoadedExport": "hfexport.artifacts",
    "LoadedComponent": "hfexport.artifacts",
    "ArtifactError": "hfexport.artifacts",
    "ManifestError": "hfexport.artifacts",
    "UnsafePathError": "hfexport.artifacts",
    "UntrustedArtifactError": "hfexport.artifacts",
    "ArtifactExistsError": "hfexport.artifacts",
    "FailedValidationWarning": "hfexport.artifacts",
    "ExportedModel": "hfexport.modeling",
    "ExportedModelForCausalLM": "hfexport.modeling",
    "ExportedModelForSeq2SeqLM": "hfexport.modeling",
    "ExportedModelForFeatureExtraction": "hfexport.modeling",
    "ExportedModelForSequenceClassification": "hfexport.modeling",
    "AutoExportedModel": "hfexport.modeling",
    "ExportQuantizer": "hfexport.quantizers.base",
    "PT2EQuantizer": "hfexport.quantizers.pt2e",
    "NNCFTorchFXQuantizer": "hfexport.quantizers.nncf",
    "NNCFOnnxQuantizer": "hfexport.quantizers.nncf",
    "NNCFOpenVINOQuantizer": "hfexport.quantizers.nncf",
    "NNCFQuantizationConfig": "hfexport.quantizers.nncf",
    "NNCFWeightCompressionConfig": "hfexport.quantizers.nncf",
    "OnnxRuntimeQuantizer": "hfexport.quantizers.onnxruntime",
    "OnnxRuntimeStaticConfig": "hfexport.quantizers.onnxruntime",
    "OnnxRuntimeDynamicConfig": "hfexport.quantizers.onnxruntime",
    "TorchAOQuantizer": "hfexport.quantizers.torchao",
    # Each backend's exporter and config class (`DynamoExporter`, `OnnxConfig`, ...), named by its descriptor.
    **{name: module for each in backends() for name, module in each.public_names.items()},
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr("hfexport", _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
