"""``torchrun`` with one line per failure: the same flags, the same launch.

    python -m runtime.torchrun --standalone --nproc-per-node 4 -m runtime.server --cp 2 --tp 2

``torchrun`` itself ends every failed launch with a Python traceback of its own
(``ChildFailedError``, and ``SignalException`` after Ctrl-C or SIGTERM), after the
ranks' own message. This front runs torchrun's launcher in process and reports instead:

- a rank that exits with code 2 or 3 (``runtime.serve`` / ``runtime.server``: a bad
  flag or launch, a lost peer) has printed its one line; nothing is added;
- a rank that exits otherwise (a crash, a signal) gets one line naming it (not the
  ranks torchrun stopped because of it);
- Ctrl-C / SIGTERM stop the ranks as torchrun does, quietly;

and exits with the failed rank's code (128 + the signal for a signal). torchrun's own
warnings are kept to errors.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

OWN_MESSAGE_CODES = frozenset({2, 3})
"""Exit codes after which a rank of this project has printed its own line."""


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # torchrun's loggers read it when made
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog = "runtime.torchrun"
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as err:
        return _report(err.failures, err.get_first_failure()[0])
    except SignalException as err:
        return 128 + int(err.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


def _report(failures: dict, first: int) -> int:
    """One line per rank that failed without a message of its own, leaving out the
    ranks torchrun stopped (SIGTERM/SIGKILL) because another failed; the exit code of
    the ``first`` rank to fail."""
    stopped = {-signal.SIGTERM, -signal.SIGKILL}
    causes = {r: f for r, f in failures.items() if int(f.exitcode) not in stopped}
    for rank, failure in sorted((causes or failures).items()):
        code = int(failure.exitcode)
        if code in OWN_MESSAGE_CODES:
            continue
        how = f"signal {failure.signal_name()}" if code < 0 else f"exit code {code}"
        print(f"runtime.torchrun: error: rank {rank} ended with {how}", file=sys.stderr)
    code = int(failures[first].exitcode)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
