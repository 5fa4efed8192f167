"""Loads the generated gRPC stubs, generating them first when needed.

Exposes ``attention_pb2`` and ``attention_pb2_grpc`` (the modules protoc generates for attention.proto), and
``sequences_pb2`` / ``sequences_pb2_grpc`` for sequences.proto (None when the checkout has no sequences.proto).

The stubs live in ``flashserve/_proto/`` (generated, git-ignored). They are (re)generated with grpcio-tools here when
  * they are absent (editable install whose build hook did not run, plain source checkout on PYTHONPATH);
  * the .proto they were made from differs from the one found next to the package (editable installs follow
    edits of proto/flashserve/v1/attention.proto);
  * importing them fails, e.g. protobuf's gencode/runtime version check refuses them.
When the package directory is not writable they are generated into a per-user cache directory instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from . import _codegen

_PACKAGE_DIR = Path(__file__).resolve().parent


def _cache_dir(sha: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashserve" / f"stubs-{sha[:16]}"


def _writable(directory: Path) -> bool:
    probe = directory if directory.exists() else directory.parent
    return os.access(probe, os.W_OK)


def _drop_modules() -> None:
    for name in list(sys.modules):
        if name == "flashserve._proto" or name.startswith("flashserve._proto."):
            del sys.modules[name]


def _import_from(out_dir: Path):
    """Imports flashserve._proto.{attention,sequences}_pb2{,_grpc} from out_dir (sequences: None if absent)."""
    _drop_modules()
    if out_dir != _PACKAGE_DIR / "_proto":
        spec = importlib.util.spec_from_file_location(
            "flashserve._proto", out_dir / "__init__.py", submodule_search_locations=[str(out_dir)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules["flashserve._proto"] = package
        spec.loader.exec_module(package)
    modules = [importlib.import_module("flashserve._proto.attention_pb2"),
               importlib.import_module("flashserve._proto.attention_pb2_grpc")]
    if (out_dir / "sequences_pb2.py").is_file():
        modules += [importlib.import_module("flashserve._proto.sequences_pb2"),
                    importlib.import_module("flashserve._proto.sequences_pb2_grpc")]
    else:
        modules += [None, None]
    return tuple(modules)


def _load():
    out_dir = _PACKAGE_DIR / "_proto"
    proto_root = _codegen.find_proto_root(_PACKAGE_DIR)
    sha = _codegen.proto_sha256(proto_root) if proto_root is not None else None
    present = _codegen.stubs_present(out_dir)
    fresh = present and (sha is None or _codegen.read_stamp(out_dir).get("proto_sha256") == sha)

    import_error = None
    if fresh:
        try:
            return _import_from(out_dir)
        except Exception as e:  # noqa: BLE001 - e.g. protobuf's or grpc's gencode/runtime version check
            import_error = e
    if proto_root is None:
        raise ImportError(
            f"flashserve: the generated gRPC stubs in {out_dir} are missing or unusable ({import_error!r}) and "
            "attention.proto cannot be found to regenerate them; reinstall flashserve or set FLASHSERVE_PROTO_ROOT "
            "to the repository's proto/ directory"
        ) from import_error

    if not _writable(out_dir):
        out_dir = _cache_dir(sha)
        if import_error is None and _codegen.stubs_present(out_dir) and \
                _codegen.read_stamp(out_dir).get("proto_sha256") == sha:
            try:
                return _import_from(out_dir)
            except Exception as e:  # noqa: BLE001 - regenerate below
                import_error = e
    try:
        _codegen.generate(proto_root, out_dir)
    except RuntimeError as e:
        if present and import_error is None:
            # Stale stubs and no grpcio-tools to refresh them: better than nothing, but say so.
            warnings.warn(f"{e}; using the stubs in {_PACKAGE_DIR / '_proto'} generated from an older .proto")
            return _import_from(_PACKAGE_DIR / "_proto")
        if import_error is not None:
            raise ImportError(f"flashserve: importing the generated stubs failed: {import_error}; and {e}") \
                from import_error
        raise ImportError(str(e)) from e
    return _import_from(out_dir)


attention_pb2, attention_pb2_grpc, sequences_pb2, sequences_pb2_grpc = _load()

__all__ = ["attention_pb2", "attention_pb2_grpc", "sequences_pb2", "sequences_pb2_grpc"]
