"""``python -m runtime.server``: Ctrl-C is one line and exit code 130."""

from runtime.launch import exit_process, interruptible
from runtime.server.main import main

exit_process(interruptible(main, "runtime.server"))
