"""`python -m braid.launch_server --model-path <Gemma-2 folder>` answers chat completions with Gemma's turn format.

No Gemma tokenizer ships offline here, so the tiny model's tokenizer is SmolLM2's (a real BPE tokenizer) with
Gemma's special tokens added (<bos>, <eos>, <start_of_turn>, <end_of_turn>) and a chat template written for Gemma's
format: `<bos><start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n...`, assistant turns named `model`,
no system role (Gemma-2's template refuses it). The model is a random tiny Gemma2ForCausalLM saved by HF's
save_pretrained, its vocabulary the tokenizer's size, <end_of_turn> among its EOS ids as in Gemma-2-it.
"""

import copy
import json
import openai
import pytest
import torch
from real_server import start_server

API_KEY = "gemma-key"
GEMMA_TURNS_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('Gemma-2 has no system role') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Hello! Who are you?"}, {"role": "assistant", "content": "A tiny model."},
            {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    import transformers

    from braid.runtime.loader.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("gemma2_chat")
    tok = copy.deepcopy(load_tokenizer("smollm2"))  # the cached one is shared with every Engine in this process
    tok.add_special_tokens({"bos_token": "<bos>", "eos_token": "<eos>",
                            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_TURNS_TEMPLATE
    tok.save_pretrained(folder)
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    cfg = transformers.Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                                    max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                                    eos_token_id=[tok.eos_token_id, end_of_turn], pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder), tok


@pytest.fixture(scope="module")
def client(gemma_folder):
    srv = start_server(["--model-path", gemma_folder[0], "--max-total-tokens", "4096", "--api-key", API_KEY,
                        "--log-level", "warning"], API_KEY, "braid-gemma2-")
    yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    srv.stop()


def test_chat_completion_uses_gemma_turns(client, gemma_folder):
    from braid.runtime import Engine

    folder, tok = gemma_folder
    r = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0, max_tokens=12)
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<bos><start_of_turn>user\nHello! Who are you?<end_of_turn>\n<start_of_turn>model\n")
    assert prompt.endswith("<start_of_turn>user\nTell me about the sea.<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode(prompt, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and 1 <= r.usage.completion_tokens <= 12
    # the server's greedy answer is what the in-process engine generates from the templated ids
    with Engine(model_path=folder, max_total_tokens=2048, log_level="warning") as engine:
        want = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 12})
    assert choice.message.content == want["text"] and r.usage.completion_tokens == len(want["output_ids"])


def test_system_role_is_refused_with_400(client):
    with pytest.raises(openai.BadRequestError, match="system role"):
        client.chat.completions.create(model="default", max_tokens=4,
                                       messages=[{"role": "system", "content": "Be brief."}, *MESSAGES])


def test_tools_on_a_template_without_system_role(client, gemma_folder):
    """braid's tool instructions open the first user turn instead of a system message the template would refuse:
    the request is served, and its prompt holds the instructions inside Gemma's first user turn."""
    from braid.runtime.server.tools import template_refuses_system

    folder, tok = gemma_folder
    assert template_refuses_system(tok.chat_template)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"]}}}]
    r = client.chat.completions.create(model="default", messages=MESSAGES[:1], tools=tools, tool_choice="required",
                                       max_tokens=40, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Paris")
    plain = client.chat.completions.create(model="default", messages=MESSAGES[:1], max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20
