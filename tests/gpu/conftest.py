"""The GPU check's failures, written down as each happens (HSYNC_CHECK_FAILURES names the file): a
section cut off at its time limit never reaches pytest's summary, and a GPU is lent too rarely to run
a check again only to read why a test failed."""

import os

import pytest


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("HSYNC_CHECK_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"\n### {report.nodeid} ({report.when})\n\n```\n{report.longreprtext[-6000:]}\n```\n")
