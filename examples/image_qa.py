"""Ask about images. Needs a vision model (e.g. LLaVA-OneVision); the embedded SmolLM2 reads text only.

Run: python examples/image_qa.py [MODEL_PATH] [IMAGE ...]
Without images, two generated pictures are used.
"""

import sys

from PIL import Image, ImageDraw

import braid


def sample_images():
    red = Image.new("RGB", (224, 224), "white")
    ImageDraw.Draw(red).ellipse((40, 40, 184, 184), fill="red")
    blue = Image.new("RGB", (224, 224), "white")
    ImageDraw.Draw(blue).rectangle((40, 40, 184, 184), fill="blue")
    return [red, blue]


@braid.function
def describe(s, images):
    with s.user():
        for img in images:
            s += braid.image(img)
        s += "What shape and color is in each picture?"
    s += braid.assistant(braid.gen("answer", max_tokens=64))


def main():
    model_path = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    images = sys.argv[2:] or sample_images()
    runtime = braid.Runtime(model_path=model_path)
    try:
        state = describe.run(images=images, backend=runtime, temperature=0)
        print(state["answer"])
    except (braid.BackendRequestError, braid.UnsupportedFeatureError) as e:
        print(f"{model_path} cannot read these images (is it a vision model?): {e}")
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
