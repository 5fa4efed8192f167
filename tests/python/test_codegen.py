"""Stub generation: not committed, generated from proto/ on demand, regenerated when the .proto changes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import flashserve
from flashserve import _codegen

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(flashserve.__file__).resolve().parent


def test_stubs_are_git_ignored_and_untracked():
    if not (REPO_ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    rel = "client/python/flashserve/_proto/attention_pb2.py"
    tracked = subprocess.run(["git", "ls-files", "client/python/flashserve/_proto"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout
    assert tracked == ""
    assert subprocess.run(["git", "check-ignore", "-q", rel], cwd=REPO_ROOT).returncode == 0


def test_generate_writes_a_self_contained_package(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dependency of flashserve) is not installed")
    out = tmp_path / "stubs_pkg"
    _codegen.generate(REPO_ROOT / "proto", out)
    for name in ("__init__.py", "attention_pb2.py", "attention_pb2.pyi", "attention_pb2_grpc.py", "STAMP.json"):
        assert (out / name).is_file(), name
    grpc_module = (out / "attention_pb2_grpc.py").read_text()
    assert "from . import attention_pb2 as" in grpc_module and "from flashserve.v1" not in grpc_module
    stamp = json.loads((out / "STAMP.json").read_text())
    assert stamp["proto_sha256"] == _codegen.proto_sha256(REPO_ROOT / "proto")
    assert (out / "src" / "flashserve" / "v1" / "attention.proto").read_bytes() == (
        REPO_ROOT / "proto" / "flashserve" / "v1" / "attention.proto").read_bytes()
    # Importable on its own, and registers the canonical file name (what reflection serves).
    code = ("import stubs_pkg.attention_pb2_grpc as g, stubs_pkg.attention_pb2 as p;"
            "assert p.DESCRIPTOR.name == 'flashserve/v1/attention.proto';"
            "assert p.DESCRIPTOR.services_by_name['AttentionService'].full_name == 'flashserve.v1.AttentionService';"
            "assert hasattr(g, 'AttentionServiceStub')")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)


def test_source_checkout_generates_on_import_and_follows_proto_edits(tmp_path):
    """A copy of client/python + proto/ with no stubs, used from PYTHONPATH (what an editable install sees)."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dependency of flashserve) is not installed")
    package = tmp_path / "client" / "python" / "flashserve"
    shutil.copytree(PACKAGE_DIR, package, ignore=shutil.ignore_patterns("_proto", "__pycache__"))
    shutil.copytree(REPO_ROOT / "proto", tmp_path / "proto")
    # The copy shadows any installed flashserve; other PYTHONPATH entries (e.g. where grpcio-tools
    # was installed on a machine without a venv) stay reachable.
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "client" / "python")] + inherited))
    env.pop("FLASHSERVE_PROTO_ROOT", None)
    probe = "import flashserve, json; print(flashserve.attention_pb2.__file__)"

    first = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert Path(first.stdout.strip()).parent == package / "_proto"
    sha_before = json.loads((package / "_proto" / "STAMP.json").read_text())["proto_sha256"]

    proto = tmp_path / "proto" / "flashserve" / "v1" / "attention.proto"
    proto.write_text(proto.read_text().replace("  string build = 9;", "  string build = 9;\n  string added_field = 99;"))
    probe2 = "import flashserve; print('added_field' in flashserve.attention_pb2.ServerInfo.DESCRIPTOR.fields_by_name)"
    second = subprocess.run([sys.executable, "-c", probe2], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "True"
    assert json.loads((package / "_proto" / "STAMP.json").read_text())["proto_sha256"] != sha_before
