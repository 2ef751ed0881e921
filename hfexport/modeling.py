"""Saved exports as models in transformers' style: `from_pretrained`, `__call__` returning `ModelOutput`s,
`generate`, `.config`, `.device`, `.dtype`, and a place in `transformers.pipeline`.

    model = hfexport.ExportedModelForCausalLM.from_pretrained("gen/", trust=True)   # any format
    tokenizer = AutoTokenizer.from_pretrained("gen/")                                # saved beside the export
    tokens = model.generate(**tokenizer(["Hi"], return_tensors="pt"), max_new_tokens=16)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)

Built on `hfexport.load` (every listed file checked before anything opens; the config and generation config are
read only when the manifest lists them, so their sha256 was verified too) and, for a generation export
(`hfexport export --generation`), `hfexport.runtime.generate` / `prompt_logits`, which run on every backend.

These classes are not `PreTrainedModel`s: they hold no weights and no modules, and subclassing would bring
`nn.Module`'s machinery and transformers' weight loading with it. They offer what transformers' pipelines read
(`config`, `generation_config`, `device`, `dtype`, `can_generate`, `generate`, `__call__`, `to`). A pipeline
checks the model's class name against the transformers classes of its task and logs an error line listing
every one of them for a class it does not know; that line is dropped for these classes (`_PipelineClassCheck`),
and the pipeline runs them. `generate` implements greedy search and sampling
(temperature, top-k, top-p) with `min_new_tokens`, `eos_token_id`, `pad_token_id` and a streamer; other
generation strategies (beam search, repetition penalty, stop strings, ...) raise `ValueError`, never run
silently as greedy.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.artifacts.errors import ArtifactError
from hfexport.artifacts.hf_files import listed_hf_files
from hfexport.artifacts.loaded import LoadedExport, load
from hfexport.core.errors import InputError
from hfexport.core.model_files import code_needed


class _PipelineClassCheck(logging.Filter):
    """Drops transformers' "The model 'ExportedModelFor...' is not supported for <task>. Supported models are [...]".

    `Pipeline.check_model_type` compares the class name with its task's transformers classes and logs that error
    (some 200 class names on one line) for any other class, then runs the model anyway; transformers special-cases
    PEFT's wrappers the same way (huggingface/transformers#36887), optimum's ORTModel classes meet the same line
    (huggingface/optimum#163). Only the record naming one of this module's classes is dropped: every other
    record of that logger, that message for any other class included, passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("The model 'ExportedModel") and "' is not supported for " in message)


def _quiet_pipeline_class_check() -> None:
    pipelines = logging.getLogger("transformers.pipelines.base")  # transformers' `logging.get_logger(__name__)`
    if not any(isinstance(f, _PipelineClassCheck) for f in pipelines.filters):
        pipelines.addFilter(_PipelineClassCheck())


_quiet_pipeline_class_check()

# Python flags transformers models take that an exported graph has fixed (the export ran with the defaults).
_FLAGS = ("return_dict", "use_cache", "output_attentions", "output_hidden_states", "return_loss")
# Inputs with a documented default when left out: transformers models treat a missing mask as all ones and
# missing token types as all zeros, so feeding those is exactly the model's behaviour.
_DEFAULTS = {"attention_mask": torch.ones_like, "token_type_ids": torch.zeros_like}
# GenerationConfig fields and their values under which `generate` here does what transformers' does; any other
# value asks for a strategy or a logits processor the runtime does not apply.
_NEUTRAL = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "sequence_bias": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
    "penalty_alpha": None,
    "guidance_scale": None,
    "stop_strings": None,
    "exponential_decay_length_penalty": None,
    "watermarking_config": None,
    "constraints": None,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
}
# Keyword arguments of transformers' generate that need nothing here: pipelines pass the tokenizer along
# (for stop strings, refused above when set), and `generate` has nothing to synchronise.
_IGNORED_GENERATE_KWARGS = ("tokenizer", "synced_gpus", "use_model_defaults")


def _dtype(config: Any) -> torch.dtype:
    value = getattr(config, "dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    return torch.float32


def _read_config(loaded: LoadedExport, want_config: bool = True, trust_remote_code: bool = False) -> tuple[Any, Any]:
    """The config (when `want_config`) and generation config the artifact lists (their sha256 checked by `load`),
    or None each."""
    listed = set(listed_hf_files(loaded.manifest))
    config = generation_config = None
    if want_config and "config.json" in listed:
        from transformers import AutoConfig

        # Never transformers' default (None: it asks on stdin whether to run the code, and runs it on "y").
        needs = code_needed({"config.json": (loaded.directory / "config.json").read_bytes()})
        if needs is not None and not trust_remote_code:
            raise ArtifactError(
                f"{loaded.directory}: {needs}: pass config= (e.g. the model's own config), or "
                "trust_remote_code=True to run that code (its files are listed in the manifest and checksummed)"
            )
        config = AutoConfig.from_pretrained(
            str(loaded.directory), local_files_only=True, trust_remote_code=trust_remote_code
        )
    if "generation_config.json" in listed:
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_pretrained(str(loaded.directory), local_files_only=True)
    return config, generation_config


class ExportedModel:
    """A saved export (`hfexport.save`, `hfexport export`) used like a transformers model.

    `from_pretrained(folder, trust=...)` loads it; `model(**inputs)` runs it in its own runtime and returns a
    `ModelOutput` of torch tensors (`last_hidden_state`, `logits`...). The base class picks its output class
    from the artifact's outputs; the subclasses fix the task.
    """

    main_input_name: ClassVar[str] = "input_ids"
    # Whether the class needs a generation export (`export_for_generation`, `hfexport export --generation`).
    needs_generation: ClassVar[bool] = False

    def __init__(self, loaded: LoadedExport, config: Any = None, generation_config: Any = None) -> None:
        if self.needs_generation and loaded.generation is None:
            raise ArtifactError(
                f"{loaded.directory} is not a generation export: {type(self).__name__} needs one (hfexport export "
                "--generation, or save the result of export_for_generation)"
            )
        self.loaded = loaded
        self.config = config
        self.generation_config = generation_config
        self.name_or_path = str(loaded.directory)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        trust: bool = False,
        verify: bool = True,
        config: Any = None,
        generation_config: Any = None,
        trust_remote_code: bool = False,
        **kwargs: Any,
    ) -> ExportedModel:
        """Load the artifact in `directory` (`hfexport.load`: `trust=True` for a `.pt2`) with its saved config.

        `config` / `generation_config` replace the saved ones (an artifact saved without them needs `config`).
        A saved config that needs Python code of its own (`auto_map`) is refused unless `trust_remote_code=True`
        (never asked on stdin: `trust` is about the `.pt2`'s pickle, not about this code).
        Other keyword arguments of transformers' `from_pretrained` that cannot apply to an exported graph
        (`dtype`, `device_map`, ...) raise `TypeError`, except `local_files_only` (always the case here).
        """
        kwargs.pop("local_files_only", None)
        if kwargs:
            raise TypeError(f"from_pretrained of an export takes no {sorted(kwargs)}: the graph fixes them")
        loaded = load(directory, trust=trust, verify=verify, open_runtimes=False)
        try:
            saved_config, saved_generation = _read_config(loaded, config is None, trust_remote_code)
        except ArtifactError:
            raise
        except Exception as exc:  # transformers on a listed file it cannot read: OSError, ValueError, TypeError...
            raise ArtifactError(
                f"{directory}: its config.json or generation_config.json does not load in transformers: "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            ) from exc
        config = config if config is not None else saved_config
        if config is None:
            raise ArtifactError(
                f"{directory} lists no config.json: export it again (hfexport export, or hfexport.save(..., "
                "model=model)) or pass config="
            )
        return cls(loaded, config, generation_config if generation_config is not None else saved_generation)

    # -- what transformers' code reads off a model --------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Outputs come back as CPU tensors from every runtime (the runtimes here run on the CPU)."""
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return _dtype(self.config)

    @property
    def export_format(self) -> str:
        return self.loaded.export_format

    def to(self, *args: Any, **kwargs: Any) -> ExportedModel:
        """Only the CPU and the exported dtype: an exported graph is not moved or cast after export."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, (str, torch.device)) and torch.device(value).type != "cpu":
                raise ValueError(f"an exported {self.export_format} graph runs on the CPU here, not {value}")
            if isinstance(value, torch.dtype) and value != self.dtype:
                raise ValueError(f"the graph was exported in {self.dtype}; export again for {value}")
        return self

    def eval(self) -> ExportedModel:
        return self

    def can_generate(self) -> bool:
        return False

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """A single forward graph does not generate: the error says which export does."""
        raise ArtifactError(
            f"{self.name_or_path} is one forward graph of {self.loaded.manifest.get('model_class') or 'the model'}, "
            "not a generation export, so it cannot generate: export it with `hfexport export --generation` (or "
            "--task text-generation), or save the result of export_for_generation"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name_or_path!r}, format={self.export_format!r})"

    # -- forward -----------------------------------------------------------------------------------------------

    def _component(self) -> Any:
        components = self.loaded.components
        if len(components) != 1:
            raise InputError(
                f"{self.name_or_path} has components {list(components)}; {type(self).__name__} runs a single export"
            )
        return next(iter(components.values()))

    def _feed(self, component: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The kwargs the component takes: flags and None dropped, documented defaults filled, others refused."""
        takes = set(component.inputs)
        feed = {}
        for name, value in inputs.items():
            if value is None or (name in _FLAGS and name not in takes):
                continue
            if name not in takes:
                raise InputError(f"{self.name_or_path} takes {component.inputs}, not {name!r}")
            feed[name] = torch.as_tensor(value)
        reference = feed.get(self.main_input_name)
        for name in component.inputs:
            if name not in feed and name in _DEFAULTS and reference is not None:
                feed[name] = _DEFAULTS[name](reference)
        return {name: feed[name] for name in component.inputs if name in feed}

    def _output_class(self, outputs: Mapping[str, Any]) -> Any:
        """The ModelOutput class of the forward: chosen from the artifact's output names (subclasses fix it)."""
        from transformers.modeling_outputs import (
            BaseModelOutput,
            BaseModelOutputWithPooling,
            CausalLMOutput,
            Seq2SeqLMOutput,
        )

        if "last_hidden_state" in outputs:
            return BaseModelOutputWithPooling if "pooler_output" in outputs else BaseModelOutput
        return Seq2SeqLMOutput if "encoder_last_hidden_state" in outputs else CausalLMOutput

    def _output(self, outputs: Mapping[str, Any]) -> Any:
        cls = self._output_class(outputs)
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: torch.as_tensor(v) for k, v in outputs.items() if k in fields})

    def forward(self, **inputs: Any) -> Any:
        """Run the export on forward kwargs; a `ModelOutput` of the fields the artifact returns."""
        component = self._component()
        return self._output(component.run(self._feed(component, inputs)))

    def __call__(self, *args: Any, **inputs: Any) -> Any:
        if args:  # model(input_ids) as transformers allows
            if len(args) > 1:
                raise TypeError("pass inputs other than the first by name")
            inputs[self.main_input_name] = args[0]
        return self.forward(**inputs)


class ExportedModelForFeatureExtraction(ExportedModel):
    """An encoder export (`AutoModel`, e.g. BERT): `last_hidden_state` (and `pooler_output`)."""


class ExportedModelForSequenceClassification(ExportedModel):
    """A sequence-classification export: `logits` `[batch, num_labels]`."""

    def _output_class(self, outputs: Mapping[str, Any]) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput


class _GenerativeModel(ExportedModel):
    """What the generation exports share: `generate` over `hfexport.runtime.generate`."""

    needs_generation = True

    def can_generate(self) -> bool:
        return True

    def _generation_arguments(self, generation_config: Any, kwargs: dict[str, Any]) -> Any:
        """The generation config of one call: the saved one (or transformers' defaults), then `generation_config`
        replacing it, then `kwargs` on top, as transformers' generate merges them. Raises `ValueError` for a
        setting the runtime does not implement, or an argument it does not know."""
        from transformers import GenerationConfig

        base = generation_config or self.generation_config or GenerationConfig()
        config = copy.deepcopy(base)
        unused = config.update(**kwargs)
        unknown = sorted(k for k in unused if k not in _IGNORED_GENERATE_KWARGS)
        if unknown:
            raise ValueError(f"generate() of an exported model takes no {unknown}")
        changed = {k: getattr(config, k) for k, v in _NEUTRAL.items() if getattr(config, k, v) not in (v, None)}
        if changed:
            raise ValueError(
                f"generate() of an exported model runs greedy search and sampling only; {changed} needs a strategy "
                "or logits processor it does not apply"
            )
        return config

    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: Any = None,
        streamer: Any = None,
        **kwargs: Any,
    ) -> Any:
        """`model.generate` over the export: token ids `[batch, prompt + new]` (the decoder's ids for an
        encoder-decoder), greedy tokens equal to the source model's with the same cache kind.

        Takes transformers' arguments (`max_new_tokens`, `max_length`, `min_new_tokens`, `do_sample`,
        `temperature`, `top_k`, `top_p`, `eos_token_id`, `pad_token_id`, `streamer`, `generation_config`,
        `return_dict_in_generate`); `generator=` (a `torch.Generator`) makes sampling reproducible.
        """
        from hfexport.runtime.generation import generate

        generator = kwargs.pop("generator", None)
        encoder_inputs = {k: kwargs.pop(k) for k in list(kwargs) if torch.is_tensor(kwargs[k])}
        config = self._generation_arguments(generation_config, kwargs)
        if input_ids is None and not encoder_inputs:
            raise InputError("generate() needs input_ids")
        prompt = 0 if input_ids is None or self.loaded.generation.is_encoder_decoder else input_ids.shape[-1]
        if config.max_new_tokens is not None:
            max_new = config.max_new_tokens
        else:  # max_length (transformers' default 20) counts the prompt, or an encoder-decoder's start token
            start = 1 if self.loaded.generation.is_encoder_decoder else prompt
            max_new = (config.max_length if config.max_length is not None else 20) - start
        min_new = config.min_new_tokens
        if min_new is None:
            min_new = max((config.min_length or 0) - prompt, 0)
        pad = config.pad_token_id
        if pad is None:  # as transformers: pad finished rows with the (first) end-of-sequence token
            eos = config.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        sequences = generate(
            self.loaded,
            input_ids,
            attention_mask,
            max_new_tokens=max_new,
            do_sample=bool(config.do_sample),
            temperature=config.temperature if config.temperature is not None else 1.0,
            top_k=config.top_k or None,
            top_p=config.top_p if config.top_p is not None and config.top_p < 1.0 else None,
            eos_token_id=config.eos_token_id,
            pad_token_id=pad,
            streamer=streamer,
            min_new_tokens=min_new,
            encoder_inputs=encoder_inputs or None,
            generator=generator,
        )
        if self.loaded.generation.is_encoder_decoder and _returns_new_tokens_only(self.config):
            sequences = sequences[:, 1:]  # the decoder start token the runtime began from
        if config.return_dict_in_generate:
            from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

            encoder_decoder = self.loaded.generation.is_encoder_decoder
            return (GenerateEncoderDecoderOutput if encoder_decoder else GenerateDecoderOnlyOutput)(sequences=sequences)
        return sequences


def _returns_new_tokens_only(config: Any) -> bool:
    """Whether the source model's `generate` returns the new tokens without the decoder prompt: transformers'
    Whisper generation (`WhisperGenerationMixin`, also used by models built on Whisper) does, other models
    return the decoder start token first."""
    import transformers
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    architecture = (getattr(config, "architectures", None) or [""])[0]
    cls = getattr(transformers, architecture, None) if architecture else None
    return isinstance(cls, type) and issubclass(cls, WhisperGenerationMixin)


class ExportedModelForCausalLM(_GenerativeModel):
    """A decoder-only generation export: `generate`, and `model(**inputs).logits` from its first graph on an
    empty cache (`hfexport.runtime.prompt_logits`), `[batch, sequence, vocab]` like the model's forward."""

    def forward(self, **inputs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from hfexport.runtime.generation import prompt_logits

        for name in _FLAGS:
            inputs.pop(name, None)
        if inputs.get("past_key_values") is not None:
            raise InputError("an exported model keeps its cache inside generate(); call it without past_key_values")
        inputs.pop("past_key_values", None)
        input_ids = inputs.pop("input_ids", None)
        if input_ids is None:
            raise InputError("the forward of an exported causal LM needs input_ids")
        mask, positions = inputs.pop("attention_mask", None), inputs.pop("position_ids", None)
        if any(v is not None for v in inputs.values()):
            raise InputError(
                f"the forward of an exported causal LM takes input_ids, attention_mask and "
                f"position_ids, not {sorted(inputs)}"
            )
        logits = prompt_logits(self.loaded, input_ids, mask, positions)
        return CausalLMOutputWithPast(logits=torch.as_tensor(logits))


class ExportedModelForSeq2SeqLM(_GenerativeModel):
    """An encoder-decoder generation export (T5, BART, Whisper): `generate` runs the encoder once, then the
    decoder steps from the start token. Its forward (teacher forcing) is not exported: use `generate`."""

    def forward(self, **inputs: Any) -> Any:
        raise InputError(
            "an encoder-decoder generation export runs through generate(); its forward with decoder_input_ids is "
            "not one of the exported graphs"
        )


def _class_for(loaded: LoadedExport, config: Any) -> type[ExportedModel]:
    """The class of an artifact: the generation layout decides, then the class the manifest says was exported,
    then the architecture the config names."""
    spec = loaded.generation
    if spec is not None:
        return ExportedModelForSeq2SeqLM if spec.is_encoder_decoder else ExportedModelForCausalLM
    exported = loaded.manifest.get("model_class")
    architecture = exported if isinstance(exported, str) and exported else ""
    if not architecture:
        architectures = getattr(config, "architectures", None)
        named = architectures[0] if isinstance(architectures, list) and architectures else ""
        architecture = named if isinstance(named, str) else ""  # config data: anything but a name is none
    if architecture.endswith("ForSequenceClassification"):
        return ExportedModelForSequenceClassification
    if architecture.endswith("Model"):
        return ExportedModelForFeatureExtraction
    return ExportedModel


class AutoExportedModel:
    """`AutoExportedModel.from_pretrained(folder, trust=...)`: the class that fits the saved export."""

    @classmethod
    def from_pretrained(cls, directory: str | Path, **kwargs: Any) -> ExportedModel:
        model = ExportedModel.from_pretrained(directory, **kwargs)
        target = _class_for(model.loaded, model.config)
        return target(model.loaded, model.config, model.generation_config)
