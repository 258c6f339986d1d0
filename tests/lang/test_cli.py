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

    from braid.runtime.chat_format import load_chat_template, with_chat_template

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
    from braid.runtime.chat_format import with_chat_template

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


# SGLang v0.3.0..v0.3.6 launch_server flags -> a value SGLang takes (None: a switch); braid picks values it supports
# where it has the flag, since this checks the names
SGLANG_V03_FLAGS = {
    "--model-path": "smollm2", "--tokenizer-path": "smollm2", "--host": "0.0.0.0", "--port": "30001",
    "--additional-ports": "30002", "--tokenizer-mode": "auto", "--skip-tokenizer-init": None, "--load-format": "auto",
    "--dtype": "half", "--kv-cache-dtype": "fp8_e5m2", "--trust-remote-code": None, "--is-embedding": None,
    "--context-length": "2048", "--quantization": "fp8", "--served-model-name": "m", "--chat-template": "chatml",
    "--revision": "main", "--device": "cuda", "--mem-fraction-static": "0.8", "--max-running-requests": "64",
    "--max-num-reqs": "64", "--max-total-tokens": "4096", "--chunked-prefill-size": "2048",
    "--max-prefill-tokens": "8192", "--schedule-policy": "dfs-weight", "--schedule-conservativeness": "1.0",
    "--cpu-offload-gb": "0", "--tensor-parallel-size": "1", "--tp-size": "1", "--stream-interval": "1",
    "--random-seed": "1", "--constrained-json-whitespace-pattern": "[ ]?", "--watchdog-timeout": "300",
    "--download-dir": "/tmp", "--base-gpu-id": "0", "--log-level": "info", "--log-level-http": "info",
    "--log-requests": None, "--show-time-cost": None, "--enable-metrics": None, "--decode-log-interval": "40",
    "--api-key": "k", "--file-storage-pth": "SGLang_storage", "--enable-cache-report": None,
    "--data-parallel-size": "1", "--dp-size": "1", "--load-balance-method": "round_robin",
    "--nccl-init-addr": "127.0.0.1:5000", "--dist-init-addr": "127.0.0.1:5000", "--nnodes": "1", "--node-rank": "0",
    "--json-model-override-args": "{}", "--enable-double-sparsity": None, "--ds-channel-config-path": "c.json",
    "--ds-heavy-channel-num": "32", "--ds-heavy-token-num": "256", "--ds-heavy-channel-type": "qk",
    "--ds-sparse-decode-threshold": "4096", "--lora-paths": "adapter", "--max-loras-per-batch": "8",
    "--attention-backend": "torch_native", "--sampling-backend": "pytorch", "--grammar-backend": "outlines",
    "--disable-flashinfer": None, "--disable-flashinfer-sampling": None, "--disable-radix-cache": None,
    "--disable-regex-jump-forward": None, "--disable-jump-forward": None, "--disable-cuda-graph": None,
    "--disable-cuda-graph-padding": None, "--disable-disk-cache": None, "--disable-outlines-disk-cache": None,
    "--disable-custom-all-reduce": None, "--disable-mla": None, "--enable-mla": None, "--disable-penalizer": None,
    "--disable-nan-detection": None, "--enable-nan-detection": None, "--enable-overlap-schedule": None,
    "--disable-overlap-schedule": None, "--enable-mixed-chunk": None, "--enable-dp-attention": None,
    "--enable-torch-compile": None, "--max-torch-compile-bs": "16", "--torch-compile-max-bs": "16",
    "--cuda-graph-max-bs": "80", "--torchao-config": "int8wo", "--enable-p2p-check": None,
    "--triton-attention-reduce-in-fp32": None, "--efficient-weight-load": None, "--num-continuous-decode-steps": "1",
    "--delete-ckpt-after-loading": None,
}


def _parse(argv, capsys):
    """(ServerArgs or None, notices, the error text)."""
    from braid.runtime.launch import parse_args_and_notices

    try:
        server_args, notices = parse_args_and_notices(argv)
        return server_args, notices, ""
    except SystemExit as e:
        assert e.code == 2
        return None, [], capsys.readouterr().err


def test_every_sglang_v03_flag_is_taken_or_answered_with_what_to_use_instead(capsys):
    accepted, refused = [], []
    for flag, value in SGLANG_V03_FLAGS.items():
        server_args, notices, err = _parse([flag] + ([] if value is None else [value]), capsys)
        assert "unrecognized arguments" not in err and "invalid choice" not in err and "usage:" not in err, err
        if server_args is None:
            assert len(err.splitlines()) == 1 and f"error: {flag}" in err and "(an SGLang flag) is not supported: " in err
            refused.append(flag)
        else:
            assert all("(an SGLang flag) has no effect: " in n for n in notices)
            accepted.append(flag)
    assert {"--is-embedding", "--skip-tokenizer-init", "--disable-flashinfer"} <= set(refused)
    assert {"--tensor-parallel-size", "--enable-mla", "--grammar-backend", "--schedule-policy"} <= set(accepted)


def test_sglang_spellings_map_onto_braids_fields(capsys):
    server_args, notices, _ = _parse(["--tensor-parallel-size", "2", "--data-parallel-size", "3",
                                      "--max-torch-compile-bs", "8", "--attention-backend", "torch_native",
                                      "--json-model-override-args", '{"rope_theta": 5.0}', "--enable-mla",
                                      "--load-balance-method", "shortest_queue"], capsys)
    assert (server_args.tp_size, server_args.dp_size, server_args.torch_compile_max_bs) == (2, 3, 8)
    assert server_args.attention_backend == "torch"
    assert server_args.disable_cuda_graph  # the torch backend cannot be captured: graphs off, as SGLang does
    assert server_args.model_config_overrides() == {"rope_theta": 5.0}
    assert notices == ["--enable-mla (an SGLang flag) has no effect: MLA is on by default for DeepSeek-V2 models "
                       "(--disable-mla turns it off)",
                       "--load-balance-method shortest_queue (an SGLang flag) has no effect: with --dp-size > 1 braid "
                       "sends each request to the group with the fewest in flight (shortest_queue); there is no "
                       "round_robin"]


def test_sglang_values_braid_lacks_and_contradictions_are_refused(capsys):
    for argv, words in ((["--tokenizer-mode", "slow"], "--tokenizer-mode slow (an SGLang flag) is not supported"),
                        (["--load-balance-method", "round_robin"], "there is no round_robin"),
                        (["--grammar-backend", "xgrammar"], "invalid choice: 'xgrammar'"),
                        (["--enable-mla", "--disable-mla"], "--enable-mla and --disable-mla contradict each other"),
                        (["--enable-overlap-schedule", "--disable-overlap-schedule"], "contradict each other"),
                        (["--log-level", "verbose"], "log_level 'verbose' is not one of debug, info"),
                        (["--device", "xpu"], "invalid choice: 'xpu'")):
        server_args, _, err = _parse(argv, capsys)
        assert server_args is None and words in err, (argv, err)
    _, _, err = _parse(["--is-embedding", "--skip-tokenizer-init"], capsys)
    assert len(err.splitlines()) == 2 and "--skip-tokenizer-init (an SGLang flag)" in err, err


def test_an_sglang_flag_that_server_args_gains_is_left_to_server_args():
    import argparse

    from braid.runtime.sglang_flags import add_sglang_flags, check_sglang_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-mla", action="store_true")  # as if ServerArgs had the field
    add_sglang_flags(parser)
    args = parser.parse_args(["--enable-mla"])
    assert args.enable_mla is True and check_sglang_flags(args) == ([], [])
