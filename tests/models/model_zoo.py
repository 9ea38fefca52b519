"""The model families tests/models/ runs through torch.compile(backend="dnngraph"): how to build
each (random weights, no downloads) at a size, its inputs and the tensor a step is judged by.

This module imports torch and the model libraries only: the worker that uses it must reach
dnngraph the way a user does, through the backend's name.

A family is `Family(name, library, build)`; `build(size, device)` returns `(model, inputs,
output)`: the model (float32, train mode), a dict of keyword inputs (floating ones float32) and
`output(result) -> tensor`, the tensor the step is judged by (its gradient drives the backward).
Sizes: "tiny" (CPU: 1-2 layers, hidden 32-64, a few tokens) and "realistic" (GPU).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

SIZES = ("tiny", "realistic")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    library: str  # the module the family needs ("transformers", "timm", "torchvision")
    build: Callable


def _pick(size: str, tiny, realistic):
    return tiny if size == "tiny" else realistic


def _ids(batch: int, seq: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), device=device)


def _text(size):
    """(batch, sequence, vocabulary) of a text model's inputs."""
    return _pick(size, (2, 7, 96), (2, 256, 32000))


def _no_dropout() -> dict:
    """Dropout off under every name the configs use: a training step is deterministic and can be
    compared with float64 (dropout's own kernels have their own tests)."""
    names = ("attn_pdrop", "embd_pdrop", "resid_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
             "dropout", "attention_dropout", "activation_dropout", "dropout_rate", "hidden_dropout",
             "qa_dropout", "seq_classif_dropout", "summary_first_dropout", "classifier_dropout")
    return {name: 0.0 for name in names}


def _causal_lm(config_name: str, model_name: str, tiny: dict, realistic: dict):
    """A decoder-only family: ids in, logits out."""
    def build(size, device):
        import transformers

        batch, seq, vocab = _text(size)
        settings = dict(_pick(size, tiny, realistic), vocab_size=vocab, use_cache=False, **_no_dropout())
        config = getattr(transformers, config_name)(**settings)
        model = getattr(transformers, model_name)(config).to(device)
        return model, {"input_ids": _ids(batch, seq, vocab, device)}, lambda result: result.logits
    return build


def _llama_like(heads_kv: int) -> tuple:
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=heads_kv, max_position_embeddings=64, head_dim=8)
    realistic = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
                     num_key_value_heads=4 * heads_kv, max_position_embeddings=4096, head_dim=64)
    return tiny, realistic


def _gpt2(size, device):
    import transformers

    batch, seq, vocab = _text(size)
    shape = _pick(size, dict(n_layer=2, n_embd=32, n_head=4), dict(n_layer=2, n_embd=768, n_head=12))
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=max(seq, 16), use_cache=False,
                                     bos_token_id=0, eos_token_id=0, **shape, **_no_dropout())
    model = transformers.GPT2LMHeadModel(config).to(device)
    return model, {"input_ids": _ids(batch, seq, vocab, device)}, lambda result: result.logits


def _encoder_text(config_name: str, model_name: str, tiny: dict, realistic: dict):
    """An encoder family (masked LM head): ids and a padding mask in, logits out."""
    def build(size, device):
        import transformers

        batch, seq, vocab = _text(size)
        config = getattr(transformers, config_name)(vocab_size=vocab, max_position_embeddings=max(seq, 16),
                                                    pad_token_id=0, **_pick(size, tiny, realistic), **_no_dropout())
        model = getattr(transformers, model_name)(config).to(device)
        mask = torch.ones(batch, seq, dtype=torch.long, device=device)
        mask[-1, seq - 2:] = 0  # the last sequence is padded: the attention mask is live
        inputs = {"input_ids": _ids(batch, seq, vocab, device), "attention_mask": mask}
        return model, inputs, lambda result: result.logits
    return build


def _t5(size, device):
    import transformers

    batch, seq, vocab = _text(size)
    shape = _pick(size, dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4),
                  dict(d_model=768, d_kv=64, d_ff=2048, num_layers=2, num_decoder_layers=2, num_heads=12))
    config = transformers.T5Config(vocab_size=vocab, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
                                   relative_attention_num_buckets=8, **shape, **_no_dropout())
    model = transformers.T5ForConditionalGeneration(config).to(device)
    inputs = {"input_ids": _ids(batch, seq, vocab, device), "decoder_input_ids": _ids(batch, seq - 2, vocab, device)}
    return model, inputs, lambda result: result.logits


def _vit(size, device):
    import transformers

    batch, image, patch = _pick(size, (2, 16, 8), (4, 224, 16))
    shape = _pick(size, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
                  dict(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072))
    config = transformers.ViTConfig(image_size=image, patch_size=patch, num_labels=10, **shape, **_no_dropout())
    model = transformers.ViTForImageClassification(config).to(device)
    pixels = torch.randn(batch, 3, image, image, device=device)
    return model, {"pixel_values": pixels}, lambda result: result.logits


def _clip(size, device):
    import transformers

    batch, seq, vocab = _text(size)
    image, patch = _pick(size, (16, 8), (224, 32))
    text = _pick(size, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
                 dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8))
    vision = _pick(size, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
                   dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12))
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=vocab, max_position_embeddings=max(seq, 16), pad_token_id=0, bos_token_id=0,
                         eos_token_id=1, **text, **_no_dropout()),
        vision_config=dict(image_size=image, patch_size=patch, **vision, **_no_dropout()),
        projection_dim=_pick(size, 16, 512))
    model = transformers.CLIPModel(config).to(device)
    # tokenized text ends in its EOS token, where CLIP pools the text tower; without one it pools
    # position 0, which attends to itself alone under the causal mask: q's and k's gradients are
    # then zero in exact arithmetic, and any fp32 rounding is an unbounded relative error
    ids = _ids(batch, seq, vocab, device).clamp(min=2)
    ids[:, -1] = config.text_config.eos_token_id
    inputs = {"input_ids": ids,
              "pixel_values": torch.randn(batch + 1, 3, image, image, device=device)}
    return model, inputs, lambda result: result.logits_per_image


def _whisper_encoder(size, device):
    import transformers
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    batch, mels, frames = _pick(size, (2, 16, 24), (2, 80, 3000))
    shape = _pick(size, dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64),
                  dict(d_model=768, encoder_layers=2, encoder_attention_heads=12, encoder_ffn_dim=3072))
    config = transformers.WhisperConfig(num_mel_bins=mels, max_source_positions=frames // 2, **shape,
                                        **_no_dropout())
    model = WhisperEncoder(config).to(device)
    features = torch.randn(batch, mels, frames, device=device)
    return model, {"input_features": features}, lambda result: result.last_hidden_state


_LLAMA = _llama_like(heads_kv=2)
TRANSFORMERS = [
    Family("gpt2", "transformers", _gpt2),
    Family("bert", "transformers", _encoder_text(
        "BertConfig", "BertForMaskedLM",
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
        dict(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072))),
    Family("distilbert", "transformers", _encoder_text(
        "DistilBertConfig", "DistilBertForMaskedLM", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64),
        dict(dim=768, n_layers=2, n_heads=12, hidden_dim=3072))),
    Family("t5", "transformers", _t5),
    Family("llama", "transformers", _causal_lm("LlamaConfig", "LlamaForCausalLM", *_LLAMA)),
    Family("mistral", "transformers", _causal_lm("MistralConfig", "MistralForCausalLM", *_LLAMA)),
    Family("qwen2", "transformers", _causal_lm("Qwen2Config", "Qwen2ForCausalLM", *_LLAMA)),
    Family("gemma2", "transformers", _causal_lm(
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(_LLAMA[0], sliding_window=4, query_pre_attn_scalar=8),
        dict(_LLAMA[1], sliding_window=128, query_pre_attn_scalar=64))),
    Family("phi", "transformers", _causal_lm(
        "PhiConfig", "PhiForCausalLM",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             partial_rotary_factor=0.5, max_position_embeddings=64),
        dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16,
             partial_rotary_factor=0.5, max_position_embeddings=4096))),
    Family("vit", "transformers", _vit),
    Family("clip", "transformers", _clip),
    Family("whisper_encoder", "transformers", _whisper_encoder),
]

def _image(size):
    """(batch, image side, classes) of a vision model's inputs."""
    return _pick(size, (2, 64, 10), (8, 224, 1000))


def _torchvision(name: str):
    def build(size, device):
        import torchvision

        batch, side, classes = _image(size)
        model = getattr(torchvision.models, name)(weights=None, num_classes=classes).to(device)
        return model, {"x": torch.randn(batch, 3, side, side, device=device)}, lambda logits: logits
    return build


def _timm(name: str, **settings):
    def build(size, device):
        import timm

        batch, side, classes = _image(size)
        extra = dict(settings, img_size=side) if "img_size" in settings else settings
        model = timm.create_model(name, pretrained=False, num_classes=classes, **extra).to(device)
        return model, {"x": torch.randn(batch, 3, side, side, device=device)}, lambda logits: logits
    return build


TORCHVISION = [Family(f"torchvision_{name}", "torchvision", _torchvision(name))
               for name in ("resnet18", "mobilenet_v3_small", "efficientnet_b0", "vgg11_bn", "densenet121")]
# drop_rate/drop_path_rate stay at timm's default of 0: training steps are deterministic
TIMM = [Family(f"timm_{name}", "timm", _timm(name, **settings)) for name, settings in (
    ("resnet18", {}), ("efficientnet_b0", {}), ("mobilenetv3_small_100", {}), ("convnext_atto", {}),
    ("vit_tiny_patch16_224", {"img_size": None}), ("deit_tiny_patch16_224", {"img_size": None}),
    ("regnetx_002", {}), ("densenet121", {}))]

ALL = TRANSFORMERS + TORCHVISION + TIMM
