"""What the ranks of the integration and application tests import, imported once by the fork server that
tests.spawn forks every rank from: the frameworks take 5 to 10 s to import on a 2-core machine, in each rank
of each test otherwise. A framework that is not installed is left out (its tests skip)."""

import contextlib
import importlib

for module in ("hsync.integrations.transformers", "hsync.integrations.accelerate", "hsync.integrations.lightning",
               "transformers.models.bert.modeling_bert"):
    with contextlib.suppress(ImportError):
        importlib.import_module(module)
