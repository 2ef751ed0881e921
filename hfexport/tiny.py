"""Built-in tiny models, built from config with fixed seeds, so the CLI and docs work offline.

They have random weights: use them to try the pipeline, not to judge output quality. `family` says what
the sample inputs look like: `causal_lm` (token ids), `seq2seq` (encoder ids + decoder ids), `speech_seq2seq`
(log-mel features + decoder ids) and `image_text` (ids with image placeholder tokens + pixels). The
single-graph exporters trace the model's whole forward on these inputs; the generation split into
components (prefill/decode, encoder/decoder) is `export_for_generation`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_COMMON = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class TinyModel:
    name: str
    model_type: str
    config: dict[str, Any]
    auto_class: str = "AutoModelForCausalLM"
    description: str = ""
    sample_shape: tuple[int, int] = field(default=(2, 8))
    family: str = "causal_lm"

    def build(self, seed: int = 0) -> Any:
        import torch
        import transformers
        from transformers import CONFIG_MAPPING

        config = CONFIG_MAPPING[self.model_type](**self.config)
        torch.manual_seed(seed)
        return getattr(transformers, self.auto_class).from_config(config).eval()

    def sample_inputs(self, seed: int = 0, batch: int | None = None, length: int | None = None) -> dict[str, Any]:
        """Forward kwargs for the model, drawn from `seed` (token ids avoid the special ids 0-2); `batch` and
        `length` (text tokens) default to `sample_shape`."""
        import torch

        generator = torch.Generator().manual_seed(seed)
        batch, length = batch or self.sample_shape[0], length or self.sample_shape[1]
        vocab = self._text_config().get("vocab_size", self.config.get("vocab_size", 128))
        ids = torch.randint(3, vocab, (batch, length), generator=generator)
        if self.family == "causal_lm":
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        decoder_ids = torch.randint(3, vocab, (batch, 4), generator=generator)
        if self.family == "seq2seq":
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "decoder_input_ids": decoder_ids}
        if self.family == "speech_seq2seq":
            # Whisper's encoder takes exactly 2 * max_source_positions frames (its conv stride is 2); the text
            # axis `length` counts is the decoder's.
            frames = 2 * self.config["max_source_positions"]
            features = torch.randn(batch, self.config["num_mel_bins"], frames, generator=generator)
            return {"input_features": features, "decoder_input_ids": ids}
        if self.family == "image_text":
            vision = self.config["vision_config"]
            side, patch = vision["image_size"], vision["patch_size"]
            # One placeholder per image patch ("default" strategy drops the CLS token), then the text.
            token = self.config["image_token_index"]
            # Text never holds the image placeholder: one there would be a feature the image does not have.
            ids = ids.masked_fill(ids == token, 3)
            image_tokens = torch.full((batch, (side // patch) ** 2), token)
            ids = torch.cat([ids[:, :1], image_tokens, ids[:, 1:]], dim=1)
            pixels = torch.randn(batch, vision.get("num_channels", 3), side, side, generator=generator)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
        raise ValueError(f"unknown tiny-model family {self.family!r}")

    def _text_config(self) -> dict[str, Any]:
        return dict(self.config.get("text_config") or {})


TINY_MODELS: dict[str, TinyModel] = {
    m.name: m
    for m in (
        TinyModel("tiny-llama", "llama", dict(_COMMON), description="Llama decoder, GQA, RoPE"),
        TinyModel(
            "tiny-qwen3-moe",
            "qwen3_moe",
            {**_COMMON, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
            description="Qwen3 mixture of experts",
        ),
        TinyModel(
            "tiny-gpt2",
            "gpt2",
            {
                "vocab_size": 128,
                "n_embd": 32,
                "n_layer": 2,
                "n_head": 4,
                "n_positions": 256,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            description="GPT-2, learned positions",
        ),
        TinyModel(
            "tiny-mamba",
            "mamba",
            {
                "vocab_size": 128,
                "hidden_size": 32,
                "state_size": 8,
                "num_hidden_layers": 2,
                "expand": 2,
                "conv_kernel": 4,
                "pad_token_id": 0,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            description="Mamba state-space model (no attention)",
        ),
        TinyModel(
            "tiny-t5",
            "t5",
            {
                "vocab_size": 128,
                "d_model": 32,
                "d_kv": 8,
                "d_ff": 64,
                "num_layers": 2,
                "num_decoder_layers": 2,
                "num_heads": 4,
                "relative_attention_num_buckets": 8,
                "pad_token_id": 0,
                "eos_token_id": 1,
                "decoder_start_token_id": 0,
            },
            auto_class="AutoModelForSeq2SeqLM",
            family="seq2seq",
            description="T5 encoder-decoder, relative position buckets",
        ),
        TinyModel(
            "tiny-whisper",
            "whisper",
            {
                "vocab_size": 128,
                "d_model": 32,
                "encoder_layers": 2,
                "decoder_layers": 2,
                "encoder_attention_heads": 4,
                "decoder_attention_heads": 4,
                "encoder_ffn_dim": 64,
                "decoder_ffn_dim": 64,
                "num_mel_bins": 16,
                "max_source_positions": 16,
                "max_target_positions": 64,
                "pad_token_id": 0,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "decoder_start_token_id": 1,
                "begin_suppress_tokens": None,
                "suppress_tokens": None,
            },
            auto_class="AutoModelForSpeechSeq2Seq",
            family="speech_seq2seq",
            sample_shape=(2, 4),
            description="Whisper speech encoder-decoder (log-mel input)",
        ),
        TinyModel(
            "tiny-llava",
            "llava",
            {
                "vision_config": {
                    "model_type": "clip_vision_model",
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 4,
                    "image_size": 24,
                    "patch_size": 6,
                    "projection_dim": 32,
                },
                "text_config": {"model_type": "llama", **_COMMON},
                "image_token_index": 127,
                "projector_hidden_act": "gelu",
                "vision_feature_layer": -1,
                "vision_feature_select_strategy": "default",
                "image_seq_length": 16,
            },
            auto_class="AutoModelForImageTextToText",
            family="image_text",
            sample_shape=(2, 6),
            description="LLaVA: CLIP vision tower + projector + Llama",
        ),
    )
}


def get_tiny_model(name: str) -> TinyModel:
    try:
        return TINY_MODELS[name]
    except KeyError:
        raise KeyError(f"no built-in model {name!r}; built-ins: {', '.join(TINY_MODELS)}") from None
