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
