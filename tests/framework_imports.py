"""What the ranks of the integration and application tests import, imported once by the fork server that
tests.spawn forks every rank from: the frameworks take 5 to 10 s to import on a 2-core machine, in each rank
of each test otherwise. A framework that is not installed is left out (its tests skip)."""

import contextlib

for load in (lambda: __import__("hsync.integrations.transformers"),
             lambda: __import__("hsync.integrations.accelerate"),
             lambda: __import__("hsync.integrations.lightning"),
             lambda: __import__("transformers").BertForPreTraining):
    with contextlib.suppress(ImportError):
        load()
