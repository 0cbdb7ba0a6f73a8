"""What the wheel holds; everything else about the project is in pyproject.toml.

* ``rewarduq_exp`` and its subpackages;
* ``hydra_plugins.rewarduq_launchers``, the launchers ``conf/train.yaml`` selects: Hydra finds plugins by scanning the
  ``hydra_plugins`` namespace on ``sys.path`` (shared with hydra-submitit-launcher and others, so no
  ``hydra_plugins/__init__.py``), and an installed package must find them without the repository there;
* the config tree ``conf/`` (every yaml, and the json backbone shapes under ``conf/model/shapes``) as
  ``rewarduq_exp/conf``: the dataset and method registries, the command-line checks, the planner and ``load_run`` read
  it (``rewarduq_exp.core.config_dir`` picks the repository's ``conf/`` in a checkout, this copy when installed).
  Each folder of it is listed as a package so that setuptools ships its files without warnings.
"""

from setuptools import find_namespace_packages, setup

CONF_PACKAGES = ["rewarduq_exp.conf", *(f"rewarduq_exp.conf.{p}" for p in find_namespace_packages(where="conf"))]

setup(
    packages=[*find_namespace_packages(include=["rewarduq_exp*", "hydra_plugins.rewarduq_launchers*"]),
              *CONF_PACKAGES],
    package_dir={"rewarduq_exp.conf": "conf"},
    package_data={package: ["*.yaml", "*.json"] for package in CONF_PACKAGES},
)
