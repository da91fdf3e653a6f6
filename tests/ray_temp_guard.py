"""The check that no test writes Ray's default temporary directory (a pytest plugin).

A Ray instance keeps its files (sessions, sockets, logs, ``session_latest``) in the
temporary directory it is given (``ray.init(_temp_dir=...)``, ``ray start --temp-dir``,
``head_node_args={"temp_dir": ...}`` of ``ray.cluster_utils.Cluster``), else in Ray's
default: ``$RAY_TMPDIR/ray``, else ``$TMPDIR/ray``, else ``/tmp/ray``, one directory for
every such instance of the machine (and ``Cluster`` writes ``ray_current_cluster`` there
whatever its head was given).  A test that writes there, or needs what is there, passes
or fails by what other runs left behind.

At the start of the session this plugin notes whether that default directory exists (as
Ray computes it, from this process's environment, which the tests' subprocesses inherit).
If it does not, the first test after which it exists fails at teardown, naming what is in
it, and so does the session.  If it exists already, another Ray instance of the machine
may be writing there and the check is off, with a note at the end of the run:
``scripts/isolated.sh`` runs the tests with a default of their own that does not exist.
``tests/conftest.py`` loads it.
"""

from __future__ import annotations

import os

import pytest

STATE = pytest.StashKey[dict]()


def rays_default_temp_dir() -> str:
    """Ray's default temporary directory, as Ray computes it in this environment."""
    from ray._common.utils import get_default_ray_temp_dir

    return get_default_ray_temp_dir()


def pytest_sessionstart(session: pytest.Session) -> None:
    path = rays_default_temp_dir()
    session.config.stash[STATE] = {"path": path, "existed": os.path.lexists(path), "reported": False}


def _created(config: pytest.Config) -> dict | None:
    state = config.stash.get(STATE, None)
    if state is None or state["existed"] or not os.path.lexists(state["path"]):
        return None
    return state


def _contents(path: str) -> str:
    try:
        return ", ".join(sorted(os.listdir(path))[:20]) or "nothing"
    except OSError as e:
        return f"unreadable: {e}"


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """After the test and the fixtures it ended: fail it if it made Ray's default dir."""
    state = _created(item.config)
    if state is None or state["reported"]:
        return
    state["reported"] = True
    pytest.fail(
        f"Ray's default temporary directory {state['path']} did not exist when the tests "
        f"started and exists after this test (it holds: {_contents(state['path'])}): a Ray "
        "instance this test started had no temporary directory of its own. Give it one "
        "(ray.init(_temp_dir=...), `ray start --temp-dir`, head_node_args temp_dir for "
        "ray.cluster_utils.Cluster, which also needs RAY_TMPDIR: tests/cluster/local_cluster.py).",
        pytrace=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _created(session.config) is not None:  # also when made outside any test's teardown
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is None:
        return
    if state["existed"]:
        terminalreporter.write_line(
            f"note: Ray's default temporary directory {state['path']} existed before the tests "
            "started (another Ray instance of this machine may use it), so whether a test "
            "writes there was not checked; scripts/isolated.sh runs the tests without it")
    elif _created(config) is not None:
        terminalreporter.write_line(
            f"FAILED: the tests created Ray's default temporary directory {state['path']} "
            f"(it holds: {_contents(state['path'])}); every Ray instance a test starts needs "
            "a temporary directory of its own", red=True)
