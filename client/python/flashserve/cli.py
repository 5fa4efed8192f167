"""Command line: ``python -m flashserve info|check --address HOST:PORT``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import List, Optional

from .client import DEFAULT_ADDRESS, Client
from .errors import FlashserveError


class _OptionError(Exception):
    """A file an option names that cannot be read: exit 2, as other errors (1 means the server's answers are
    wrong)."""


def _connection(args: argparse.Namespace) -> dict:
    """Client keyword arguments for --tls-ca / --token-file."""
    kwargs = {}
    if args.tls_ca:
        import grpc

        kwargs["credentials"] = grpc.ssl_channel_credentials(root_certificates=_read("--tls-ca", args.tls_ca, "rb"))
    if args.token_file:
        kwargs["token"] = _read("--token-file", args.token_file, "r").strip()
    return kwargs


def _read(option: str, path: str, mode: str):
    """The file's contents; _OptionError when it cannot be read (missing, unreadable, a token not in UTF-8)."""
    try:
        with open(path, mode) as f:
            return f.read()
    except (OSError, ValueError) as e:
        raise _OptionError(f"{option} {path}: {getattr(e, 'strerror', None) or e}") from None


def _info(args: argparse.Namespace) -> int:
    with Client(args.address, timeout=args.timeout, **_connection(args)) as client:
        info = client.server_info()
    if args.json:
        print(json.dumps(dataclasses.asdict(info), indent=2))
        return 0
    print(f"address:        {args.address}")
    print(f"version:        {info.version}")
    print(f"backend:        {info.backend}")
    print(f"build:          {info.build}")
    print(f"dtypes:         {', '.join(info.dtypes)}")
    print(f"head_dims:      {', '.join(map(str, info.head_dims)) or '-'}")
    print(f"max_head_dim:   {info.max_head_dim}")
    print(f"worker_threads: {info.worker_threads}")
    print(f"limits:         max_request_bytes={info.limits.max_request_bytes} "
          f"max_tensor_elements={info.limits.max_tensor_elements} queue_capacity={info.limits.queue_capacity}")
    for d in info.devices:
        print(f"device {d.index}:       {d.name} (sm_{d.compute_capability[0]}{d.compute_capability[1]}, "
              f"{d.total_memory_bytes / 2**30:.1f} GiB)")
    if not info.devices:
        print("devices:        none")
    return 0


def _check(args: argparse.Namespace) -> int:
    from .check import run_check

    return run_check(args.address, seed=args.seed, quick=args.quick, timeout=args.timeout,
                     client_kwargs=_connection(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flashserve", description="flashserve client tools")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", default=DEFAULT_ADDRESS, help=f"server gRPC address (default {DEFAULT_ADDRESS})")
        p.add_argument("--timeout", type=float, default=120.0, help="per-call deadline in seconds (default 120)")
        p.add_argument("--tls-ca", help="PEM file of the CA (or self-signed cert) to trust: connect with TLS")
        p.add_argument("--token-file", help="file with the bearer token of a server started with --auth_token_file")

    p_info = sub.add_parser("info", help="print the server's version, backend, dtypes, head dims and limits")
    common(p_info)
    p_info.add_argument("--json", action="store_true", help="print JSON")
    p_info.set_defaults(func=_info)

    p_check = sub.add_parser("check", help="compare the server's answers with the fp64 reference over a grid")
    common(p_check)
    p_check.add_argument("--seed", type=int, default=0, help="random seed for the inputs (default 0)")
    p_check.add_argument("--quick", action="store_true", help="a smaller grid")
    p_check.set_defaults(func=_check)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FlashserveError as e:
        print(f"error: {args.address}: {e}", file=sys.stderr)
        return 2
    except _OptionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
