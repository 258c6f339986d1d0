"""Folder-long fixtures: a session fixture in a folder's conftest registers how to close what it started, and
tests/conftest.py closes it after the folder's last test (session scope alone keeps a server or engine alive
through every later folder of the suite)."""

import os

CLOSE_WHEN_LEAVING: dict[str, list] = {}  # a folder, as test ids begin ("tests/server") -> closers, run once


def close_when_leaving_folder(request, conftest_file: str, close) -> None:
    """`close` runs after the last test of the folder of `conftest_file` (the conftest defining the fixture); it must
    tolerate a second call (the fixture's own teardown at the end of the session)."""
    folder = os.path.relpath(os.path.dirname(os.path.abspath(conftest_file)), str(request.config.rootpath))
    CLOSE_WHEN_LEAVING.setdefault(folder.replace(os.sep, "/"), []).append(close)


def in_folder(nodeid: str, folder: str) -> bool:
    return nodeid.startswith(folder + "/")
