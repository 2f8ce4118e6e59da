"""Build step that pyproject.toml cannot declare: write ``references/index.json`` (see
preflight/catalogue_index.py) while the package is built, so that nobody maintains it by hand.
Everything else about the distribution is in pyproject.toml."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _index_module() -> Any:
    # By path: importing the preflight package would need its dependencies, which a build
    # environment does not have.
    spec = importlib.util.spec_from_file_location("_preflight_catalogue_index", os.path.join(HERE, "preflight", "catalogue_index.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithIndex(build_py):
    """build_py, plus the catalogue index: into the build tree for a wheel; for an editable
    install (setuptools sets ``editable_mode`` and copies nothing), into the checkout's
    ``references/``, where the editable package finds its references."""

    def run(self) -> None:
        super().run()
        source = os.path.join(HERE, self.get_package_dir("preflight.references"))
        target = source if self.editable_mode else self._built_references()
        _index_module().write_index(source, target)

    def _built_references(self) -> str:
        return os.path.join(self.build_lib, "preflight", "references")

    def get_output_mapping(self) -> dict[str, str]:
        # Editable installs in "strict" mode link every output to its source: the index's source
        # is the one written into the checkout.
        mapping = dict(super().get_output_mapping())
        name = _index_module().INDEX_NAME
        mapping[os.path.join(self._built_references(), name)] = os.path.join(self.get_package_dir("preflight.references"), name)
        return mapping


setup(cmdclass={"build_py": BuildPyWithIndex})
