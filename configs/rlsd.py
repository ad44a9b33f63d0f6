"""RLSD on the embedded task with the paper's hyperparameters (docs/design.md §2)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import base  # noqa: E402  (config files are loaded by path, not as a package)


def get_config():
  config = base.get_config()
  config.algorithm = "rlsd"
  return config
