"""Launch failures end the process promptly, with exit code 1 and the reason."""

import socket
import subprocess
import sys


def launch(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "braid.runtime.launch", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_port_in_use_fails_before_loading_anything():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = launch("--port", str(port), timeout=60)
    assert r.returncode == 1 and f"cannot serve on 127.0.0.1:{port}" in r.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_one_line_refusal(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 1, r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("braid: "), r.stderr
    assert "Traceback" not in r.stderr and all(w in r.stderr for w in words), r.stderr


def test_missing_model_path_fails_in_one_line():
    r = launch("--port", str(free_port()), "--model-path", "/no/such/model", timeout=60)
    assert_one_line_refusal(r, "model path not found: /no/such/model", "smollm2")


def test_unknown_architecture_fails_in_one_line_listing_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FooForCausalLM"], "model_type": "foo"}')
    r = launch(str(tmp_path), "--port", str(free_port()), timeout=60)
    assert_one_line_refusal(r, "FooForCausalLM is not supported", "LlamaForCausalLM", "Qwen2ForCausalLM")


def test_gpu_only_attention_backends_are_refused_on_cpu_at_start():
    for backend in ("triton", "flashinfer"):
        r = launch("--port", str(free_port()), "--device", "cpu", "--attention-backend", backend, timeout=60)
        assert_one_line_refusal(r, f"--attention-backend {backend} needs a CUDA GPU", "--attention-backend torch")


def test_trust_remote_code_says_it_has_no_effect():
    r = launch("--port", str(free_port()), "--trust-remote-code", "--model-path", "/no/such/model", timeout=60)
    assert r.returncode == 1
    notice, refusal = r.stderr.splitlines()
    assert "INFO" in notice and "--trust-remote-code has no effect" in notice
    assert refusal.startswith("braid: model path not found")


def test_unreadable_chat_template_is_refused_at_start():
    r = launch("--port", str(free_port()), "--chat-template", "/no/such/template.jinja", timeout=60)
    assert_one_line_refusal(r, "--chat-template", "neither a known name (chatml, gemma-it, llama-3-instruct, qwen), a file, nor a Jinja template")


def test_scheduler_failure_shows_the_exceptions_last_line_only():
    from braid.runtime.server.tokenizer_manager import last_line

    traceback_text = ('Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    f()\n'
                      'ValueError: architecture Foo is not supported\n')
    assert last_line(traceback_text) == "ValueError: architecture Foo is not supported"


def test_impossible_parallelism_fails_at_start_in_one_line():
    for flags, message in ((("--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"),
                            "tp_size=3 does not split over nnodes=2"),
                           (("--tp-size", "2", "--nnodes", "2"), "nnodes > 1 needs --dist-init-addr")):
        r = launch(*flags, timeout=60)
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "usage:" not in r.stderr and len(r.stderr.splitlines()) == 1


def test_sglang_flags_are_answered_before_anything_loads():
    r = launch("--port", str(free_port()), "--is-embedding", "--schedule-policy", "dfs-weight", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "usage:" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == ["braid.launch_server: error: --is-embedding (an SGLang flag) is not supported: "
                                     "braid serves generation models only (no /encode, no /v1/embeddings); /generate "
                                     "with return_logprob and logprob_start_len=0 scores a prompt"]
    r = launch("--port", str(free_port()), "--enable-metrics", "--tensor-parallel-size", "1",
               "--model-path", "/no/such/model", timeout=60)
    notice, refusal = r.stderr.splitlines()
    assert "INFO --enable-metrics (an SGLang flag) has no effect: GET /metrics (Prometheus) is always served" in notice
    assert r.returncode == 1 and refusal.startswith("braid: model path not found")
