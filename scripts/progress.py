"""Progress check of the hidden-state extraction; runnable while it runs and after.

    .venv/bin/python scripts/progress.py results/<run>            # table
    .venv/bin/python scripts/progress.py results/<run> --watch    # bars, every 10 s until done
    .venv/bin/python scripts/progress.py results/<run> --json     # for machines

Exit codes: 0 on track or finished, 3 will not fit, 4 a shard failed,
5 stalled (the lowest applies when several do; --json lists them all);
1 when the run directory has no plan.json, 2 for bad arguments.
"""

import sys

from draftflow.progress import main

if __name__ == "__main__":
    sys.exit(main())
