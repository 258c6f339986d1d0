"""The `braid` console script dispatches to the runtime's entry points."""

import subprocess
import sys

from braid.cli import main


def test_help_and_unknown_commands(capsys):
    assert main(["--help"]) == 0
    assert "braid serve" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert main(["bench", "nope"]) == 2


def test_serve_help_lists_server_args():
    out = subprocess.run([sys.executable, "-m", "braid.cli", "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "--model-path" in out.stdout and "--disable-radix-cache" in out.stdout


def test_sglang_and_vllm_spellings_parse_to_the_same_server_args():
    from braid.runtime.launch import parse_args

    ours = parse_args(["--model-path", "/models/Qwen2-0.5B", "--tp-size", "1", "--dp-size", "1",
                       "--disable-jump-forward", "--dtype", "float16"])
    for theirs in (["/models/Qwen2-0.5B", "--tp", "1", "--dp", "1", "--disable-regex-jump-forward", "--dtype", "half"],
                   ["--model", "/models/Qwen2-0.5B", "--tp", "1", "--dp", "1", "--disable-regex-jump-forward",
                    "--dtype", "half"]):
        assert parse_args(theirs) == ours
    assert parse_args(["--dtype", "float"]).dtype == "float32"
    assert parse_args(["--trust-remote-code"]).trust_remote_code is True


def test_dtype_aliases_also_through_keyword_arguments():
    from braid.runtime.config import ServerArgs

    assert ServerArgs(dtype="half") == ServerArgs(dtype="float16")
    assert ServerArgs.from_kwargs(dtype="float").dtype == "float32"


def test_two_different_models_are_refused(capsys):
    import pytest

    from braid.runtime.launch import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["/models/a", "--model-path", "/models/b"])
    assert e.value.code == 2 and "two models given" in capsys.readouterr().err
    assert parse_args(["/models/a", "--model-path", "/models/a"]).model_path == "/models/a"


def test_served_model_name_defaults_to_the_folder_name():
    from braid.runtime.config import ServerArgs

    assert ServerArgs().model_name == "smollm2"
    assert ServerArgs(model_path="/models/Qwen2-0.5B-Instruct/").model_name == "Qwen2-0.5B-Instruct"
    assert ServerArgs(model_path="/models/Qwen2-0.5B-Instruct", served_model_name="qwen").model_name == "qwen"


def test_chat_template_from_a_file_or_inline(tmp_path):
    import pytest

    from braid.runtime.server.tokenizer_manager import load_chat_template, with_chat_template

    inline = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(inline)
    assert load_chat_template(str(path)) == load_chat_template(inline) == inline
    with pytest.raises(ValueError, match="neither a known name .* a file, nor a Jinja template"):
        load_chat_template("/no/such/template.jinja")

    class Tokenizer:
        chat_template = None

    shared = Tokenizer()
    assert with_chat_template(shared, None) is shared
    overridden = with_chat_template(shared, inline)
    assert overridden.chat_template == inline and shared.chat_template is None


def test_braid_serve_help_shows_the_positional_model_and_aliases():
    out = subprocess.run([sys.executable, "-m", "braid.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: braid serve")
    for flag in ("MODEL", "--model", "--tp", "--dp", "--disable-regex-jump-forward", "--chat-template"):
        assert flag in out.stdout


def test_serve_without_the_runtime_extra_names_what_is_missing():
    """torch and transformers made unimportable (as in an install without braid[runtime]): one line naming them and
    the install command, exit 2, no traceback."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "from braid.cli import main; sys.exit(main(['serve', '--max-total-tokens', '64']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "torch, transformers are not installed: pip install 'braid[runtime]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_named_chat_templates_render_their_formats():
    from braid.runtime.loader.tokenizer import load_tokenizer
    from braid.runtime.server.tokenizer_manager import with_chat_template

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    expected = {
        "chatml": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye"
                  "<|im_end|>\n<|im_start|>assistant\n",
        "llama-3-instruct": "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant"
                            "<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye"
                            "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "gemma-it": "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n",
    }
    base = load_tokenizer("smollm2")
    for name, text in expected.items():
        tok = with_chat_template(base, name)
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.endswith(text), (name, rendered)
    assert base.chat_template is not None and "im_start" in base.chat_template  # the cached tokenizer is untouched
