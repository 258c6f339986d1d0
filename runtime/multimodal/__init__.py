"""Images and video for vision-language models: media loading (media.py), LLaVA-OneVision pixel processing and
placeholder counts (llava_onevision.py), and the per-request `MultimodalInputs` with content-derived pad ids
(inputs.py)."""
