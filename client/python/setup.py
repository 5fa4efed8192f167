"""Build hook: generates flashserve/_proto/ (gRPC stubs) from ../../proto with grpcio-tools.

Everything else about the package lives in pyproject.toml.
  * wheel / regular install: the stubs are written into the build directory and shipped in the wheel;
  * editable install: they are written into the source tree (flashserve/_proto/, git-ignored), and
    flashserve._pb regenerates them on import whenever the .proto changes.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _codegen():
    spec = importlib.util.spec_from_file_location("_flashserve_codegen", HERE / "flashserve" / "_codegen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        codegen = _codegen()
        package_dir = HERE / "flashserve"
        proto_root = codegen.find_proto_root(package_dir)
        if proto_root is None:
            raise RuntimeError(
                f"flashserve: cannot find {codegen.PROTO_REL} (looked in {HERE.parent.parent / 'proto'} "
                "and flashserve/_proto/src); set FLASHSERVE_PROTO_ROOT"
            )
        if getattr(self, "editable_mode", False):
            codegen.generate(proto_root, package_dir / "_proto")
        else:
            codegen.generate(proto_root, Path(self.build_lib) / "flashserve" / "_proto")


setup(cmdclass={"build_py": BuildPyWithStubs})
