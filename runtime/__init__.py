"""braid's runtime. Importing this package is cheap; `Engine` pulls in torch on first use."""


def __getattr__(name):
    if name == "Engine":
        from braid.runtime.engine import Engine

        return Engine
    if name == "ServerArgs":
        from braid.runtime.config import ServerArgs

        return ServerArgs
    raise AttributeError(name)


__all__ = ["Engine", "ServerArgs"]
