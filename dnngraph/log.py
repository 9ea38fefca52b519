"""The `dnngraph` logger. DNNGRAPH_LOG=info shows builds, compiles and cache use; =debug adds
each kernel's config and why it was chosen, and the fusion groups. Messages go to stderr unless
the application configures the logger (or the root logger) itself."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("dnngraph")
LEVELS = {"info": logging.INFO, "debug": logging.DEBUG, "warning": logging.WARNING}


def _configure_from_environment():
    wanted = os.environ.get("DNNGRAPH_LOG", "").strip().lower()
    if wanted not in LEVELS:
        return
    logger.setLevel(LEVELS[wanted])
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("dnngraph %(levelname)s: %(message)s"))
        logger.addHandler(handler)


_configure_from_environment()
