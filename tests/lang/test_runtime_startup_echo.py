"""braid.Runtime shows the server's start-up progress (its INFO lines) on stderr while it waits, errors left to
ServerStartError."""

from braid.backends.runtime import _StartupEcho


def test_info_lines_are_echoed_once_as_they_complete(tmp_path, capsys):
    log = tmp_path / "server.log"
    log.write_bytes(b"[server] INFO from an earlier run\n")
    echo = _StartupEcho(str(log))
    with open(log, "ab") as f:
        f.write(b"[scheduler 1] INFO loading model m (LlamaForCausalLM, dtype float32, device cpu)\n[sched")
    echo.echo_new_lines()
    assert capsys.readouterr().err == "[scheduler 1] INFO loading model m (LlamaForCausalLM, dtype float32, device cpu)\n"
    with open(log, "ab") as f:
        f.write(b"uler 2] INFO weights loaded: 272 tensors in 0.3 s\nbraid: model path not found: /x\n"
                b"Traceback (most recent call last):\n[server 3] INFO braid server ready on http://127.0.0.1:1\n")
    echo.echo_new_lines()
    echo.echo_new_lines()
    assert capsys.readouterr().err == ("[scheduler 2] INFO weights loaded: 272 tensors in 0.3 s\n"
                                       "[server 3] INFO braid server ready on http://127.0.0.1:1\n")
