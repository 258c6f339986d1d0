"""A tiny random LLaVA-OneVision checkpoint (SigLIP 2 layers, Qwen2 2 layers, 56px tiles of 14px patches, grids up to
3x3) written with HF's save_pretrained, and test images; shared by the multimodal model, runtime and server tests."""

import numpy as np
import torch

TILE, PATCH = 56, 14
PINPOINTS = [[TILE * i, TILE * j] for i in range(1, 4) for j in range(1, 4)]
IMAGE_TOKEN, VIDEO_TOKEN = 49150, 49151


def make_tiny_llava(folder):
    """Writes config, safetensors and preprocessor_config.json to `folder`; returns (HF model, HF PIL processor)."""
    import transformers
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config,
                              SiglipVisionConfig)

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=TILE, patch_size=PATCH)
    text = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=False)
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                  video_token_index=VIDEO_TOKEN, vision_feature_select_strategy="full",
                                  vision_feature_layer=-1, image_grid_pinpoints=PINPOINTS, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlavaOnevisionForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights large enough that images move the logits and greedy tokens have no ties
        for name, p in hf.named_parameters():
            if "language_model" in name and p.dim() > 1:
                p.normal_(0, 0.2)
            elif "multi_modal_projector" in name or "image_newline" in name:
                p.normal_(0, 1.0)
    hf.save_pretrained(folder, safe_serialization=True)
    processor = transformers.LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE},
                                                             image_grid_pinpoints=PINPOINTS)
    processor.save_pretrained(folder)
    return hf, processor


def test_image(height, width, seed):
    """A PIL image: smooth gradients plus noise (resizing matters, and images differ by seed)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) * 3) % 256], -1)
    return Image.fromarray(np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8))


test_image.__test__ = False  # a helper, not a pytest test
