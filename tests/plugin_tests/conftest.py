"""Fixtures shared by the engine-side tests."""

from __future__ import annotations

import pytest
from _engine_helpers import Staged


@pytest.fixture
def cleanup_after():
    """Candidates a test staged; each is cleaned up (and must clean) when the test ends."""
    staged: list[Staged] = []
    yield staged
    for s in staged:
        r = s.cleanup()
        assert r.status_code == 200, r.text
