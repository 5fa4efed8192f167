"""Generates the Python gRPC stubs for ``flashserve/v1/attention.proto`` with grpcio-tools.

Used in two places:
  * ``setup.py`` (build_py) when a wheel is built or an editable install is made;
  * ``flashserve._pb`` on import, when the stubs are absent, stale (the .proto changed) or were generated for a
    protobuf runtime that refuses them.

This module imports only the standard library (grpc_tools lazily), so setup.py can load it by path without importing
the flashserve package.

Output layout (``out_dir`` is normally ``flashserve/_proto/``, git-ignored)::

    __init__.py
    attention_pb2.py, attention_pb2.pyi, attention_pb2_grpc.py
    src/flashserve/v1/attention.proto     copy of the source, so an installed wheel can regenerate
    STAMP.json                            sha256 of the .proto and the grpcio-tools/protobuf versions used
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

PROTO_REL = Path("flashserve") / "v1" / "attention.proto"
STAMP_NAME = "STAMP.json"
GENERATED_FILES = ("attention_pb2.py", "attention_pb2.pyi", "attention_pb2_grpc.py")
# protoc names the module after the .proto path; our package is also called flashserve, so the absolute import
# that the grpc plugin writes would resolve inside this package. Rewritten to a relative import.
_GRPC_IMPORT = "from flashserve.v1 import attention_pb2 as"
_GRPC_IMPORT_FIXED = "from . import attention_pb2 as"


def proto_sha256(proto_root: Path) -> str:
    return hashlib.sha256((proto_root / PROTO_REL).read_bytes()).hexdigest()


def find_proto_root(package_dir: Path) -> Optional[Path]:
    """Returns the directory that holds ``flashserve/v1/attention.proto``, preferring the repository's copy.

    Order: $FLASHSERVE_PROTO_ROOT, ``<repo>/proto`` (package_dir is ``<repo>/client/python/flashserve``),
    the copy shipped in ``_proto/src``. None when no .proto can be found (an installed wheel without its copy).
    """
    candidates = []
    if os.environ.get("FLASHSERVE_PROTO_ROOT"):
        candidates.append(Path(os.environ["FLASHSERVE_PROTO_ROOT"]))
    candidates.append(package_dir.resolve().parent.parent.parent / "proto")
    candidates.append(package_dir / "_proto" / "src")
    for root in candidates:
        if (root / PROTO_REL).is_file():
            return root
    return None


def read_stamp(out_dir: Path) -> dict:
    try:
        return json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}


def stubs_present(out_dir: Path) -> bool:
    return all((out_dir / name).is_file() for name in GENERATED_FILES) and (out_dir / "__init__.py").is_file()


def _atomic_write(path: Path, data: bytes) -> None:
    # Readers in other processes see either the old or the new file, never a torn one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def generate(proto_root: Path, out_dir: Path) -> None:
    """Runs grpc_tools.protoc on ``proto_root/flashserve/v1/attention.proto`` and writes the stubs to ``out_dir``.

    Raises RuntimeError when grpcio-tools is missing or protoc fails.
    """
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - grpcio-tools is a declared dependency
        raise RuntimeError(
            "flashserve: the gRPC stubs are missing and grpcio-tools is not installed to generate them "
            "(pip install grpcio-tools)"
        ) from e

    proto_root = Path(proto_root).resolve()
    out_dir = Path(out_dir)
    source = proto_root / PROTO_REL
    if not source.is_file():
        raise RuntimeError(f"flashserve: {source} not found")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(prefix="flashserve-protoc-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(source),
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"flashserve: grpc_tools.protoc failed with exit code {rc} on {source}")
        generated_dir = Path(tmp) / PROTO_REL.parent
        contents = {name: (generated_dir / name).read_bytes() for name in GENERATED_FILES}

    grpc_module = contents["attention_pb2_grpc.py"].decode()
    if _GRPC_IMPORT not in grpc_module:
        raise RuntimeError("flashserve: unexpected grpc_tools output; cannot find the attention_pb2 import to fix")
    contents["attention_pb2_grpc.py"] = grpc_module.replace(_GRPC_IMPORT, _GRPC_IMPORT_FIXED).encode()

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "src" / PROTO_REL.parent).mkdir(parents=True, exist_ok=True)
    source_bytes = source.read_bytes()
    if (out_dir / "src").resolve() != proto_root:
        _atomic_write(out_dir / "src" / PROTO_REL, source_bytes)
    _atomic_write(out_dir / "__init__.py", b'"""Generated by flashserve._codegen from attention.proto; do not edit."""\n')
    for name, data in contents.items():
        _atomic_write(out_dir / name, data)
    stamp = {
        "proto_sha256": hashlib.sha256(source_bytes).hexdigest(),
        "grpcio_tools": _dist_version("grpcio-tools"),
        "protobuf_gencode": _gencode_version(contents["attention_pb2.py"]),
    }
    # Written last: a present stamp means a complete set of stubs.
    _atomic_write(out_dir / STAMP_NAME, (json.dumps(stamp, indent=1) + "\n").encode())


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def _gencode_version(pb2_source: bytes) -> str:
    """The protobuf version protoc wrote into the module header ("# Protobuf Python Version: 6.31.1")."""
    for line in pb2_source.decode(errors="replace").splitlines()[:20]:
        if line.startswith("# Protobuf Python Version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"
