"""One configuration per mesh: what every rank of a launch must agree on before any work.

Every rank of ``runtime.serve`` / ``runtime.server`` runs the same model, cache and
requests in lockstep; a rank started with another ``--seed``, another ``--page-size`` or
another prompts file would compute something else (wrong outputs with exit code 0) or
block a collective (a timeout that blames a dead peer). So at start-up each rank states
its :func:`work_config`, every flag that changes the work (by value) and the content of
every input file (by digest), and the launch compares them before the process group
forms (``runtime.launch.init_mesh``): a difference is one line naming the flag and exit 2
on every rank.

Left out, as they may differ per rank or per node without changing the work: output
and logging flags, ``--threads``, ``--collective-timeout-s``, node-local places
(``--storage-root``, ``--mooncake-rdma-devices``) and the HTTP flags, which only rank 0
reads. A checkpoint directory is compared by its ``config.json`` content and its files'
names and sizes (not the weights' bytes: hashing gigabytes at every start would be slow);
the storage secret by its content's digest (never its bytes or path).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

RANK_LOCAL = frozenset(
    {
        "help",
        "version",
        "json",
        "dump_logits",
        "log_every",
        "log_level",
        "quiet",
        "threads",
        "collective_timeout_s",
        "storage_root",
        "mooncake_rdma_devices",
        # runtime.server's HTTP flags: rank 0 serves HTTP.
        "host",
        "port",
        "served_model_name",
        "max_tokens_limit",
        "max_prompt_tokens",
        "max_body_bytes",
        "api_key",
        "allowed_host",
        "drain_s",
    }
)
_FILES = {"prompts": "the content of --prompts", "storage_secret_file": "the storage secret"}


def _file_digest(path: str | Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as err:
        return f"unreadable ({err.strerror})"
    return "sha256 " + digest.hexdigest()[:16]


def _checkpoint_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    config = directory / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for item in sorted(directory.iterdir()):
        if item.is_file():
            digest.update(f"{item.name}\0{item.stat().st_size}\0".encode())
    return "sha256 " + digest.hexdigest()[:16]


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def work_config(args: argparse.Namespace) -> dict[str, str]:
    """The flags and inputs that change the work, as ``{name: shown value}``; a name is
    the flag (``--seed``) or a description of an input's content."""
    out: dict[str, str] = {}
    for dest, value in sorted(vars(args).items()):
        if dest in RANK_LOCAL:
            continue
        if dest in _FILES:
            if value is not None:
                out[_FILES[dest]] = _file_digest(value)
            continue
        out["--" + dest.replace("_", "-")] = _shown(value)
        if dest == "model" and Path(str(value)).is_dir():
            out["the checkpoint in --model"] = _checkpoint_digest(Path(str(value)))
    return out


def first_difference(configs: list[dict[str, str]]) -> str | None:
    """The line naming the first flag on which a rank differs from rank 0 (None: all
    agree). The same line on every rank that sees the same ``configs``."""
    reference = configs[0]
    for name in sorted(set().union(*configs)):
        ours = reference.get(name, "(not given)")
        for rank, config in enumerate(configs[1:], start=1):
            theirs = config.get(name, "(not given)")
            if theirs != ours:
                return (
                    f"the ranks disagree on {name}: rank 0 has {ours}, rank {rank} has "
                    f"{theirs}; start every rank with the same flags and inputs"
                )
    return None
