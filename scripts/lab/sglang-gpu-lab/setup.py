"""Ships ddtree_sglang_gpu_lab.pth at the top of site-packages (the boot hook; pyproject cannot say that)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "ddtree_sglang_gpu_lab.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))


setup(cmdclass={"build_py": BuildWithPth})
