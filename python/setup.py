"""Builds libdecodev2.so with cargo from the repository this directory belongs to and bundles
it in the package (`pip install ./python`); DV2_LIB=path skips the build and bundles that file."""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class BuildWithLibrary(build_py):
    def run(self):
        built = os.environ.get("DV2_LIB")
        if not built:
            subprocess.check_call(["cargo", "build", "--release", "--lib"], cwd=ROOT)
            built = ROOT / "target" / "release" / "libdecodev2.so"
        shutil.copy2(built, HERE / "decodev2" / "libdecodev2.so")
        super().run()


setup(cmdclass={"build_py": BuildWithLibrary})
