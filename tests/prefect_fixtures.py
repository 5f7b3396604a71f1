"""A shared Prefect API for flow tests: load with ``pytest_plugins = ("tests.prefect_fixtures",)``.

Registered as a plugin (not imported into each module), the session-scoped fixture is one
instance for every module that asks for it, so the harness (temporary SQLite database and server,
~10 s to start) is paid once per session.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One real Prefect API (temporary SQLite database) for the rest of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
