"""Send a rule script's output, and its subprocesses' output, to the rule's log."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def logged(log_path: str | Path) -> Iterator[None]:
    """Redirect file descriptors 1 and 2 to ``log_path`` for the block.

    Descriptor-level redirection also captures subprocesses (vLLM servers,
    speculators' CLIs). A failure's traceback is written to the log before the
    exception propagates, so Snakemake's error points at a complete log.
    """
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        try:
            yield
        except BaseException:
            traceback.print_exc()
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
