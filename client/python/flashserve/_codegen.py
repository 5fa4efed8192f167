"""Generates the Python gRPC stubs for ``flashserve/v1/attention.proto`` (and ``sequences.proto``, the server-side
KV cache API, when the checkout has it) with grpcio-tools.

Used in two places:
  * ``setup.py`` (build_py) when a wheel is built or an editable install is made;
  * ``flashserve._pb`` on import, when the stubs are absent, stale (the .proto changed) or were generated for a
    protobuf runtime that refuses them.

This module imports only the standard library (grpc_tools lazily), so setup.py can load it by path without importing
the flashserve package.

Output layout (``out_dir`` is normally ``flashserve/_proto/``, git-ignored)::

    __init__.py
    attention_pb2.py, attention_pb2.pyi, attention_pb2_grpc.py
    sequences_pb2.py, sequences_pb2.pyi, sequences_pb2_grpc.py   (when sequences.proto exists)
    src/flashserve/v1/*.proto             copies of the sources, so an installed wheel can regenerate
    STAMP.json                            sha256 of the .protos and the grpcio-tools/protobuf versions used
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

PROTO_REL = Path("flashserve") / "v1" / "attention.proto"
# Optional protos beside attention.proto: generated when present (sequences.proto imports attention.proto).
OPTIONAL_PROTO_RELS = (Path("flashserve") / "v1" / "sequences.proto",)
STAMP_NAME = "STAMP.json"
GENERATED_FILES = ("attention_pb2.py", "attention_pb2.pyi", "attention_pb2_grpc.py")
# protoc names the module after the .proto path; our package is also called flashserve, so the absolute imports
# that protoc and the grpc plugin write would resolve inside this package. Rewritten to relative imports.
_ABSOLUTE_IMPORT = re.compile(r"^from flashserve\.v1 import (\w+_pb2) as", re.MULTILINE)
_GRPC_IMPORT = "from flashserve.v1 import attention_pb2 as"


def proto_rels(proto_root: Path) -> List[Path]:
    """attention.proto and every optional .proto that exists under proto_root."""
    return [PROTO_REL] + [rel for rel in OPTIONAL_PROTO_RELS if (proto_root / rel).is_file()]


def generated_files(rel: Path) -> Tuple[str, str, str]:
    stem = rel.stem
    return (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py")


def proto_sha256(proto_root: Path) -> str:
    """sha256 of attention.proto alone (as before), or of every present .proto with its name when there are more."""
    rels = proto_rels(proto_root)
    if len(rels) == 1:
        return hashlib.sha256((proto_root / PROTO_REL).read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for rel in rels:
        digest.update(str(rel).encode() + b"\0" + (proto_root / rel).read_bytes() + b"\0")
    return digest.hexdigest()


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
    """The attention stubs, and those of every .proto the stamp lists, are all there."""
    names = list(GENERATED_FILES)
    for rel in read_stamp(out_dir).get("protos", []):
        names += generated_files(Path(rel))
    return all((out_dir / name).is_file() for name in names) and (out_dir / "__init__.py").is_file()


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
    """Runs grpc_tools.protoc on ``proto_root/flashserve/v1/attention.proto`` (and the optional protos present) and
    writes the stubs to ``out_dir``.

    Raises RuntimeError when grpcio-tools is missing or protoc fails.
    """
    proto_root = Path(proto_root).resolve()
    out_dir = Path(out_dir)
    if not (proto_root / PROTO_REL).is_file():
        raise RuntimeError(f"flashserve: {proto_root / PROTO_REL} not found")
    rels = proto_rels(proto_root)
    contents = _run_protoc(proto_root, rels)
    if _GRPC_IMPORT not in contents["attention_pb2_grpc.py"].decode():
        raise RuntimeError("flashserve: unexpected grpc_tools output; cannot find the attention_pb2 import to fix")
    for name, data in contents.items():
        contents[name] = _ABSOLUTE_IMPORT.sub(r"from . import \1 as", data.decode()).encode()

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "src" / PROTO_REL.parent).mkdir(parents=True, exist_ok=True)
    if (out_dir / "src").resolve() != proto_root:
        for rel in rels:
            _atomic_write(out_dir / "src" / rel, (proto_root / rel).read_bytes())
    _atomic_write(out_dir / "__init__.py",
                  b'"""Generated by flashserve._codegen from proto/flashserve/v1; do not edit."""\n')
    for name, data in contents.items():
        _atomic_write(out_dir / name, data)
    stamp = {
        "proto_sha256": proto_sha256(proto_root),
        "protos": [str(rel) for rel in rels],
        "grpcio_tools": _dist_version("grpcio-tools"),
        "protobuf_gencode": _gencode_version(contents["attention_pb2.py"]),
    }
    # Written last: a present stamp means a complete set of stubs.
    _atomic_write(out_dir / STAMP_NAME, (json.dumps(stamp, indent=1) + "\n").encode())


def _run_protoc(proto_root: Path, rels: List[Path]) -> dict:
    """{generated file name: bytes} for every .proto in rels."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - grpcio-tools is a declared dependency
        raise RuntimeError(
            "flashserve: the gRPC stubs are missing and grpcio-tools is not installed to generate them "
            "(pip install grpcio-tools)"
        ) from e
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(prefix="flashserve-protoc-") as tmp:
        args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"] + [str(proto_root / rel) for rel in rels]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"flashserve: grpc_tools.protoc failed with exit code {rc} on {rels}")
        contents = {}
        for rel in rels:
            generated_dir = Path(tmp) / rel.parent
            for name in generated_files(rel):
                contents[name] = (generated_dir / name).read_bytes()
        return contents


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
