"""Which TorchTitan the adapter runs on, checked before it imports any of TorchTitan.

The package installs beside the TorchTitan a project already has (pyproject.toml asks for
a range), so the TorchTitan found can be one this adapter was not written for: TorchTitan
0.3 has no TOML job config, no train-spec registry and no ``--experimental.custom_import``,
the three points this adapter plugs into. Such a TorchTitan is refused at the adapter's
import, by version, with what to do instead, rather than with the first missing module.
The engine and the optimizer (``import torchtitan_dmuon``) import no TorchTitan and work
with any.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["SUPPORTED_TORCHTITAN", "UnsupportedTorchTitan", "check_torchtitan"]

SUPPORTED_TORCHTITAN = "0.2.2"
"""The TorchTitan release the adapter is built and tested on (scripts/constraints.txt)."""


class UnsupportedTorchTitan(ImportError):
    """The TorchTitan installed is missing or one the adapter does not support."""


def check_torchtitan(version: str | None = None) -> str:
    """The installed TorchTitan's version, if the adapter supports it.

    Args:
        version: The version to check (default: the installed distribution's).

    Raises:
        UnsupportedTorchTitan: TorchTitan is not installed, or its release (local labels
            such as ``+git`` aside) is not :data:`SUPPORTED_TORCHTITAN`.
    """
    if version is None:
        try:
            version = importlib.metadata.version("torchtitan")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedTorchTitan(
                f"torchtitan_dmuon.titan (run_train.sh, the [dmuon] TOML section) needs "
                f"TorchTitan {SUPPORTED_TORCHTITAN}, and none is installed: pip install "
                f"torchtitan=={SUPPORTED_TORCHTITAN}"
            ) from None
    if version.split("+")[0] != SUPPORTED_TORCHTITAN:
        raise UnsupportedTorchTitan(
            f"torchtitan_dmuon.titan (run_train.sh, the [dmuon] TOML section) supports "
            f"TorchTitan {SUPPORTED_TORCHTITAN}; this environment has TorchTitan {version}. "
            "TorchTitan 0.3 has no TOML job config, train-spec registry or "
            "--experimental.custom_import, which this adapter plugs into, and its adapter is "
            "not built yet. With it, use the engine directly: torchtitan_dmuon.dedicate_params "
            "before fully_shard, then torchtitan_dmuon.Muon (docs/python.md); or train "
            f"through this adapter in an environment with torchtitan=={SUPPORTED_TORCHTITAN}."
        )
    return version
