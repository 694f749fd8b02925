"""`smolnet secret init|path`."""

from __future__ import annotations

from smolnet.secret import ensure_secret, file_mode, secret_path


def add_arguments(p) -> None:
    p.add_argument(
        "action", choices=["init", "path"], help="init: create the secret if missing; path: print where it is"
    )
    p.add_argument("--secret-file", default=None, help="default: ~/.config/smolcluster/secret")


def run(args) -> int:
    path = secret_path(args.secret_file)
    if args.action == "init":
        existed = path.exists()
        ensure_secret(path)
        print(f"{path}: {'exists' if existed else 'created'} (mode {file_mode(path):04o})")
    else:
        print(path)
    return 0
