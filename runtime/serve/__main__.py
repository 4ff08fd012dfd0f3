"""``python -m runtime.serve``: Ctrl-C is one line and exit code 130."""

from runtime.launch import exit_process, interruptible
from runtime.serve.main import main

exit_process(interruptible(main, "runtime.serve"))
