"""The attention backend registry: names resolve lazily, unavailable ones say why."""

import pytest


def test_flashinfer_backend_reports_why_it_is_unavailable():
    import importlib.util

    from braid.runtime.layers.attention.registry import get_backend_class

    with pytest.raises(ValueError, match="flashinfer") as info:
        get_backend_class("flashinfer")
    if importlib.util.find_spec("flashinfer") is None:
        assert "pip install flashinfer-python" in str(info.value)
    else:
        assert "not implemented" in str(info.value)


def test_unknown_backend_lists_the_known_ones():
    from braid.runtime.layers.attention.registry import get_backend_class

    with pytest.raises(ValueError, match="choose from flashinfer, torch, triton"):
        get_backend_class("xformers")
