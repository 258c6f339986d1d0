"""A tiny random LLaVA-OneVision checkpoint (SigLIP 2 layers, Qwen2 2 layers, 56px tiles of 14px patches, grids up to
3x3) written with HF's save_pretrained, and test images; shared by the multimodal model, runtime and server tests."""

import numpy as np
import torch

TILE, PATCH = 56, 14
PINPOINTS = [[TILE * i, TILE * j] for i in range(1, 4) for j in range(1, 4)]
IMAGE_TOKEN, VIDEO_TOKEN = 49150, 49151


def make_tiny_llava(folder, vocab_size=49152, image_token=IMAGE_TOKEN, video_token=VIDEO_TOKEN):
    """Writes config, safetensors and preprocessor_config.json to `folder`; returns (HF model, HF PIL processor)."""
    import transformers
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config,
                              SiglipVisionConfig)

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=TILE, patch_size=PATCH)
    text = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=False)
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                                  video_token_index=video_token, vision_feature_select_strategy="full",
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


def make_tiny_llava_with_processor(folder, chat_template):
    """The tiny checkpoint with its own tokenizer (SmolLM2's plus the special tokens <image> = 49152 and
    <video> = 49153) and `chat_template` in `folder`, as a hub OneVision-HF folder has them; returns (HF model, HF
    LlavaOnevisionProcessor). HF's video processor needs torchvision, absent here: videos go through a stand-in that
    prepares each frame as the image processor prepares an image's base tile (what LLaVA-OneVision does to frames)."""
    import copy

    import transformers

    from braid.runtime.loader.tokenizer import load_tokenizer

    tokenizer = copy.deepcopy(load_tokenizer("smollm2"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    assert tokenizer.convert_tokens_to_ids(["<image>", "<video>"]) == [49152, 49153]
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    hf, image_processor = make_tiny_llava(folder, vocab_size=len(tokenizer), image_token=49152, video_token=49153)

    class Processor(transformers.LlavaOnevisionProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    def video_processor(videos, **_):
        tiles = [torch.stack([image_processor(f, return_tensors="pt")["pixel_values"][0, 0] for f in video])
                 for video in videos]
        return {"pixel_values_videos": torch.stack(tiles)}

    processor = Processor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                          num_image_tokens=(TILE // PATCH) ** 2, vision_feature_select_strategy="full",
                          chat_template=chat_template)
    return hf, processor


def test_image(height, width, seed):
    """A PIL image: smooth gradients plus noise (resizing matters, and images differ by seed)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)), ((x + y) * 3) % 256], -1)
    return Image.fromarray(np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8))


test_image.__test__ = False  # a helper, not a pytest test
