"""Imported first by each module of this adapter that imports TorchTitan: the installed
TorchTitan must be 0.2.2 (``version.py``); 0.3's adapter, or what to do with another
release, is named in the error, before any TorchTitan module is read."""

from torchtitan_dmuon.titan.version import check_torchtitan

TORCHTITAN_VERSION = check_torchtitan("torchtitan_dmuon.titan")
