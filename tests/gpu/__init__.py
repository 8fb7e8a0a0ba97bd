"""Tests that need a CUDA device; scripts/gpu_check.sh runs them (each module skips without one)."""

import os


def note(line: str) -> None:
    """Adds a measured figure to the GPU check's report (HSYNC_CHECK_NOTES names its notes file)."""
    path = os.environ.get("HSYNC_CHECK_NOTES")
    if path:
        with open(path, "a") as f:
            f.write(f"- {line}\n")
