"""The attention backend registry: names resolve lazily, unavailable ones say why."""

import importlib.util
import sys

import pytest

FI_MODULE = "braid.runtime.layers.attention.flashinfer_backend"


def test_flashinfer_backend_without_flashinfer_says_how_to_install(monkeypatch):
    from braid.runtime.layers.attention.registry import get_backend_class

    # as if flashinfer were not installed, whether or not it is here
    for name in ("flashinfer", "flashinfer.decode", "flashinfer.prefill"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, FI_MODULE, raising=False)
    with pytest.raises(ValueError, match="flashinfer") as info:
        get_backend_class("flashinfer")
    assert "pip install flashinfer-python" in str(info.value)
    assert "attention backend 'flashinfer' is not available here" in str(info.value)


def test_flashinfer_backend_resolves_where_flashinfer_imports():
    from braid.runtime.layers.attention.registry import get_backend_class

    if importlib.util.find_spec("flashinfer") is None:
        with pytest.raises(ValueError, match="pip install flashinfer-python"):
            get_backend_class("flashinfer")
        return
    try:
        cls = get_backend_class("flashinfer")
    except ValueError as e:  # installed but broken here (e.g. its own dependencies): the reason is in the message
        assert "flashinfer" in str(e)
    else:
        assert cls.__name__ == "FlashInferAttnBackend"


def test_unknown_backend_lists_the_known_ones():
    from braid.runtime.layers.attention.registry import get_backend_class

    with pytest.raises(ValueError, match="choose from flashinfer, torch, triton"):
        get_backend_class("xformers")
