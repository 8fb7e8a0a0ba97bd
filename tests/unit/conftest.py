from pathlib import Path

import pytest

UNIT = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every unit test is in the quick lane (scripts/test.sh --quick); pytest hands this hook every item."""
    for item in items:
        if item.path.is_relative_to(UNIT):
            item.add_marker(pytest.mark.quick)
