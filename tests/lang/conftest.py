import importlib.util
from pathlib import Path

import pytest

import braid

from lang_scripted_backend import ScriptedBackend

TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture
def backend():
    return ScriptedBackend()


@pytest.fixture(autouse=True)
def _no_default_backend():
    braid.set_default_backend(None)
    yield
    braid.set_default_backend(None)


@pytest.fixture(scope="session")
def programs():
    spec = importlib.util.spec_from_file_location("braid_shared_programs", TESTS_DIR / "helpers" / "programs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
