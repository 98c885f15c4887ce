"""Which TorchTitan is installed, and which adapter of this package serves it; checked by
each adapter before it imports any of TorchTitan.

The package installs beside the TorchTitan a project already has (pyproject.toml asks for
a range), so the adapter is chosen by the TorchTitan found: 0.2.2 has a TOML job config,
a train-spec registry and ``--experimental.custom_import`` (``torchtitan_dmuon.titan``);
0.3 has none of them but config modules, a subclassable optimizer container and model
specs (``torchtitan_dmuon.titan03``). An adapter imported beside the other TorchTitan, or
either beside a release none supports, is refused at its import, by version, with what
to do instead, rather than with the first missing module. The engine and the optimizer
(``import torchtitan_dmuon``) import no TorchTitan and work with any. This module imports
none either.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["ADAPTERS", "UnsupportedTorchTitan", "adapter_for", "check_torchtitan"]

ADAPTERS = {"0.2.2": "torchtitan_dmuon.titan", "0.3.0": "torchtitan_dmuon.titan03"}
"""The TorchTitan releases this package is built and tested on, and each one's adapter."""

_HOW = {
    "torchtitan_dmuon.titan": "run_train.sh, the [dmuon] TOML section",
    "torchtitan_dmuon.titan03": "a config module's with_dmuon, --dmuon.* flags",
}


class UnsupportedTorchTitan(ImportError):
    """The TorchTitan installed is missing, or not the one the adapter serves."""


def adapter_for(version: str) -> str | None:
    """The adapter of TorchTitan ``version`` (local labels such as ``+git`` aside), or None."""
    return ADAPTERS.get(version.split("+")[0])


def check_torchtitan(adapter: str = "torchtitan_dmuon.titan", version: str | None = None) -> str:
    """The installed TorchTitan's version, if ``adapter`` serves it.

    Args:
        adapter: The adapter about to import TorchTitan (a value of :data:`ADAPTERS`).
        version: The version to check (default: the installed distribution's).

    Raises:
        UnsupportedTorchTitan: TorchTitan is not installed, or its release is another
            adapter's (naming it) or none's.
    """
    wanted = [v for v, a in ADAPTERS.items() if a == adapter]
    if not wanted:
        raise ValueError(f"{adapter!r} is not an adapter of this package: {sorted(_HOW)}")
    who = f"{adapter} ({_HOW[adapter]})"
    if version is None:
        try:
            version = importlib.metadata.version("torchtitan")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedTorchTitan(
                f"{who} needs TorchTitan {wanted[0]}, and none is installed: pip install "
                f"torchtitan=={wanted[0]}"
            ) from None
    found = adapter_for(version)
    if found == adapter:
        return version
    if found is not None:
        raise UnsupportedTorchTitan(
            f"{who} is the adapter of TorchTitan {wanted[0]}; this environment has TorchTitan "
            f"{version}, whose adapter is {found} ({_HOW[found]}; docs/torchtitan-0.3.md)"
        )
    supported = ", ".join(f"{v} ({a})" for v, a in ADAPTERS.items())
    raise UnsupportedTorchTitan(
        f"{who} supports TorchTitan {wanted[0]}; this environment has TorchTitan {version}, "
        f"which no adapter of this package serves (they serve {supported}). With it, use the "
        "engine directly: torchtitan_dmuon.dedicate_params before fully_shard, then "
        "torchtitan_dmuon.Muon (docs/python.md); or train through an adapter in an "
        f"environment with torchtitan=={wanted[0]}."
    )
