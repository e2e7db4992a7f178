"""epdserve's INFO lines for a script that configured no logging, as vLLM prints its own.

The offline API (`LLM`, `AsyncLLM.from_model`) loads a model and, where no prebuilt kernels serve,
compiles them: a script that set up no logging would otherwise wait through that without a word. An
application that configured logging (any handler on the root logger or on `epdserve`) keeps its own
settings.
"""
from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the `epdserve` command's


def use_default_logging() -> None:
    """Send epdserve's INFO lines to stderr unless the application has configured logging itself."""
    ours = logging.getLogger("epdserve")
    if logging.getLogger().handlers or ours.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
