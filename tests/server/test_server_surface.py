"""Nothing accepted and dropped: media sent to a text-only model is a 400 naming the model (native and OpenAI
routes, and braid.image() through RuntimeEndpoint fails before sending); /get_model_info says whether the
model takes images; /get_server_info shows every kernel switch."""

import openai
import pytest

import braid
from braid.backends.base import CAP_GEN, CAP_IMAGE, Prompt
from braid.backends.runtime_endpoint import RuntimeEndpoint
from braid.errors import BackendRequestError
from braid.runtime.sampling_params import SamplingParams

from server_helpers import API_KEY

PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="
NO_IMAGES = "model smollm2 takes no image input"


def _assert_error(resp, param: str, message: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and message in err["message"], err


@pytest.mark.parametrize("body", [
    {"text": "Describe the picture.", "image_data": PNG},
    {"text": "Describe the picture.", "image_data": PNG, "stream": True},
    {"text": ["a", "b"], "image_data": [PNG, PNG]},
    {"input_ids": [1, 2, 3], "image_data": [PNG]},
], ids=["text", "stream", "batch", "input_ids"])
def test_native_image_is_a_400_naming_the_model(server, body):
    _assert_error(server.post("/generate", json=body), "image_data", NO_IMAGES)


def test_native_video_is_a_400_naming_the_model(server):
    r = server.post("/generate", json={"text": "x", "image_data": [PNG, PNG], "modalities": ["video"]})
    _assert_error(r, "image_data", "model smollm2 takes no video input")


@pytest.mark.parametrize("part,kind", [
    ({"type": "image_url", "image_url": {"url": PNG}}, "image"),
    ({"type": "video_url", "video_url": {"url": "file:///tmp/clip.mp4"}}, "video"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, "audio"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_media_parts_are_a_400_naming_the_model(openai_client, model_name, part, kind, stream):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(openai.BadRequestError) as ei:
        openai_client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, stream=stream)
    err = ei.value.response.json()["error"]
    assert ei.value.status_code == 400 and err["param"] == "messages"
    assert f"model smollm2 takes no {kind} input" in err["message"]


def test_model_info_says_whether_the_model_takes_images(server):
    info = server.get("/get_model_info").json()
    assert info["is_multimodal"] is False and info["model_path"] == "smollm2" and info["context_length"] > 0


def test_runtime_endpoint_refuses_images_for_a_text_only_model(server):
    endpoint = RuntimeEndpoint(server.base_url, api_key=API_KEY)

    @braid.function
    def describe(s):
        s += braid.user(braid.image(PNG) + "What is in the picture?")
        s += braid.assistant(braid.gen("answer", max_tokens=4))

    assert endpoint.supports(CAP_GEN) and not endpoint.supports(CAP_IMAGE)
    with pytest.raises(braid.UnsupportedFeatureError, match="the served model smollm2 takes no image input"):
        describe.run(backend=endpoint)
    # below the interpreter, the server itself refuses
    with pytest.raises(BackendRequestError, match=NO_IMAGES):
        endpoint.generate(Prompt(text="hi", images=(PNG,)), SamplingParams(max_new_tokens=2))
    endpoint.shutdown()


def test_server_info_lists_the_kernel_switches(server):
    info = server.get("/get_server_info").json()
    for switch in ("disable_pdl", "disable_decode_gemv", "disable_cpu_prepack", "disable_cpu_malloc_tuning"):
        assert info[switch] is False, switch
    assert info["stream_interval"] == 1 and info["tp_size"] == 1 and info["api_key"] == "<redacted>"
