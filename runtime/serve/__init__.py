"""The ``runtime.serve`` command: flags, start-up checks, prompts files, the run."""
